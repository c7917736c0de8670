"""The syncer's Redis state on one server and on a real three-master Redis Cluster: a run's keys
share one hash slot, so its transactions, scripts and MGET work on either."""

from __future__ import annotations

import json
import threading
import time

import pytest
import redis
from helpers import assert_exact_accounting
from redis.cluster import RedisCluster
from redis.crc import key_slot
from rich.console import Console

from diloco.config import build_config
from diloco.infra import services
from diloco.run import train
from diloco.syncer import state as state_mod
from diloco.syncer.records import Where
from diloco.syncer.state import Fenced, StaleVersion, StateError, SyncerState, connect

pytestmark = pytest.mark.integration


def _documented_keys() -> set[str]:
    """The key names the module docstring lists (`round` for `round:<p>`)."""
    doc = state_mod.__doc__
    block = doc[doc.index("Keys, all under"):].split("\n\n")[0].splitlines()[1:]
    return {line.split()[0].split(":")[0] for line in block}


def _exercise(st: SyncerState) -> None:
    """Every multi-key operation of the State, with what each must answer; leaves every documented key."""
    assert st.init_versions(2) and not st.init_versions(2)                  # a second provisioning finds the run
    old, _ = st.claim(0, shard=0, member="0:a", ttl_s=1.0)
    assert old == 1 and st.claim(0, shard=1, member="1:b", ttl_s=5) == (0, "0:a")   # held by another shard
    assert st.renew(0, "0:a", 1.0) and not st.renew(0, "1:b", 5)
    st.accept(0, "c1", {"id": "c1"}, {("frag", 0): 5}, [{"topic": "events", "partition": 0, "value": "accepted"}],
              fence={0: old})
    time.sleep(1.1)                                                          # shard 0 stalls past its lease
    new, previous = st.claim(0, shard=1, member="1:b", ttl_s=5)
    assert (new, previous) == (old + 1, "0:a") and not st.renew(0, "0:a", 5)
    with pytest.raises(Fenced, match="another shard owns it"):
        st.commit_merge(0, from_version=0, ids=["c1"], late=0, record={}, offsets={}, sync_time_s=0.0, fence={0: old})
    with pytest.raises(StaleVersion, match="at version 0, merge was built on 1"):
        st.commit_merge(0, from_version=1, ids=["c1"], late=0, record={}, offsets={}, sync_time_s=0.0, fence={0: new})
    record = {"fragment": 0, "version": 1, "ids": ["c1"], "where": [["frag", 0, 5]]}
    st.commit_merge(0, from_version=0, ids=["c1"], late=0, record=record, offsets={("frag", 0): 6}, sync_time_s=0.25,
                    outbox=[{"topic": "outer", "partition": 0, "value": "merged"}], fence={0: new})
    assert st.versions() == {0: 1, 1: 0} and st.statuses() == {"c1": "applied:0:1"} and st.round(0) == {}
    assert st.merges() == [record] and st.stats() == {"sync_time_s": 0.25} and st.offsets() == {("frag", 0): 6}
    st.release(0, "0:a")
    assert st.lease_holder(0) == "1:b"                                       # not the holder's: kept
    st.release(0, "1:b")
    assert st.lease_holder(0) is None
    mine, _ = st.claim(1, shard=1, member="1:b", ttl_s=5)
    st.accept(1, "c2", {"id": "c2"}, {("frag", 1): 1}, fence={1: mine})      # stays pending
    st.reject("c3", "stale", {("frag", 1): 2}, fragment=1, fence={1: mine}, where=Where("frag", 1, 1))
    assert st.prune_statuses(("frag", 1), below=2, keep=1, fence={1: mine}) == []        # the newest is kept
    assert st.round(1) == {"c2": {"id": "c2"}} and st.status_counts() == {"applied": 1, "pending": 1, "rejected": 1}
    assert st.counters() == {"accepted": 2, "applied": 1, "late": 0, "merges": 1, "rejected": 1, "rejected:stale": 1}
    st.join(0, "0:a", 5)
    st.join(2, "2:c", 5)
    st.leave(0, "0:a")
    assert st.live_shards(3) == {2}
    st.save_events_offset(2, 7)
    st.save_read_to(1, {("frag", 0): 9})
    st.save_read_to(0, {("frag", 0): 4, ("frag", 1): 2})                     # an owner behind another: max
    assert st.read_to() == {("frag", 0): 9, ("frag", 1): 2}
    assert st.committed("events") == {("frag", 0): 6, ("frag", 1): 2, ("events", 0): 7}
    st.heartbeat("us-0", {"step": 3})
    assert st.registry() == {"us-0": {"step": 3}}
    assert st.admit("us-2", {"region": "us"}) and not st.admit("us-2", {"region": "eu"})  # admitted once
    assert st.members() == {"us-2": {"region": "us"}}
    sent = st.outbox_peek()
    assert [json.loads(r)["value"] for r in sent] == ["accepted", "merged"]
    st.dead_letter(sent[0], "refused for good")
    assert st.outbox_trim(sent[:1]) and not st.outbox_trim(sent[:1])        # the head moved: a late relayer trims nothing
    assert st.outbox_peek() == sent[1:] and st.counters()["dead_letters"] == 1


@pytest.mark.parametrize("server", ["redis_url", "redis_cluster_url"])
def test_the_state_protocol_works_with_every_key_of_the_run_in_its_slot(server, request):
    cfg = build_config({"state": {"redis_url": request.getfixturevalue(server), "cluster": server == "redis_cluster_url"}})
    r = connect(cfg.state)
    if cfg.state.cluster:
        assert isinstance(r, RedisCluster) and len(r.get_primaries()) == 3
    prefix = f"slots-{time.time_ns()}"  # this test's own key_prefix: whatever lands under it, the State wrote
    st = SyncerState(r, prefix, "run-a")
    _exercise(st)
    written = set(r.scan_iter(match=f"{prefix}:*"))
    assert {k.removeprefix(st.k).split(":")[0] for k in written} == _documented_keys()
    assert {key_slot(k.encode()) for k in written} == {key_slot(b"run-a")}  # the hash tag: only the run is hashed


def test_connecting_to_a_cluster_says_what_is_wrong(redis_cluster_url, monkeypatch):
    with pytest.raises(StateError, match=r"state.redis_url .*/3 \(state.cluster: True\).*only be 0"):
        connect(build_config({"state": {"redis_url": redis_cluster_url[:-1] + "3", "cluster": True}}).state, timeout_s=3)
    r = connect(build_config({"state": {"redis_url": redis_cluster_url, "cluster": True}}).state)
    r.config_set("requirepass", "s3cr3t-pw", target_nodes=RedisCluster.ALL_NODES)
    try:
        with pytest.raises(StateError, match="requires a password"):
            connect(build_config({"state": {"redis_url": redis_cluster_url, "cluster": True}}).state, timeout_s=3)
        cfg = build_config({"state": {"redis_url": redis_cluster_url, "cluster": True, "password_env": "DILOCO_TEST_PW"}})
        monkeypatch.setenv("DILOCO_TEST_PW", "wrong")
        with pytest.raises(StateError, match="refused the credentials"):
            connect(cfg.state, timeout_s=3)
        monkeypatch.setenv("DILOCO_TEST_PW", "s3cr3t-pw")
        assert connect(cfg.state, timeout_s=3).ping()
    finally:  # the open connections stay authenticated: the other tests get the cluster back as it was
        r.config_set("requirepass", "", target_nodes=RedisCluster.ALL_NODES)


def test_a_tiny_run_trains_with_its_state_on_a_redis_cluster(tiny_config, redis_cluster_url):
    cfg = tiny_config(state={"redis_url": redis_cluster_url, "cluster": True})
    s = train(cfg, progress=False, console=Console(quiet=True))
    assert s["contributions"]["applied"] == s["contributions"]["published"] > 0
    versions = SyncerState(connect(cfg.state), cfg.state.key_prefix, s["run_id"]).versions()
    assert len(versions) == cfg.fragments.count and min(versions.values()) > 0


@pytest.fixture
def replicated_cluster(tmp_path):
    """Three masters with a replica each, on ports of their own; a silent master is replaced in ~2 s."""
    ports = [services.free_port() for _ in range(6)]
    services.start_redis_cluster(tmp_path / "cluster", ports, replicas=1, node_timeout_ms=2000)
    yield ports
    services.stop_redis_cluster(tmp_path / "cluster")


def _role(port: int) -> dict:
    return redis.Redis(port=port, decode_responses=True).info("replication")


def test_a_master_failover_mid_run_promotes_its_replica_and_nothing_is_lost_or_applied_twice(tiny_config,
                                                                                            replicated_cluster):
    """Issue 53 item 6: mid-run, the replica of the master that holds the run's slot takes over (a
    manual CLUSTER FAILOVER: the replica catches up, then the roles swap, as in a planned failover of a
    managed Redis). The syncer follows the new master; every contribution is merged once, none is
    lost, and the accounting is exact. An unplanned failover can lose writes Redis acknowledged:
    syncer/durability.py detects that and stops the syncer by name (its own tests)."""
    url = f"redis://127.0.0.1:{replicated_cluster[0]}/0"
    run_id = f"failover-{time.time_ns() % 10**8}"
    cfg = tiny_config(state={"redis_url": url, "cluster": True}, run={"id": run_id}, inner={"steps": 160},
                      regions=[{"name": "us", "learners": 2, "speed": 0.25}, {"name": "eu", "learners": 2, "speed": 0.25}])
    result = {}
    runner = threading.Thread(target=lambda: result.update(s=train(cfg, progress=False, console=Console(quiet=True))))
    runner.start()
    try:
        cluster = RedisCluster.from_url(url, decode_responses=True)
        state = SyncerState(cluster, cfg.state.key_prefix, run_id)
        deadline = time.time() + 300
        while cluster.llen(state.k + "merges") < 4:                  # mid-run: merges made, most still to come
            assert time.time() < deadline and runner.is_alive(), "the run made no merges"
            time.sleep(0.2)
        master = cluster.nodes_manager.get_node_from_slot(key_slot(run_id.encode()))
        node = redis.Redis(port=master.port, decode_responses=True)
        (line,) = node.execute_command("CLUSTER", "REPLICAS", node.execute_command("CLUSTER", "MYID"))
        replica_port = int(line.split()[1].split("@")[0].rsplit(":", 1)[1])   # "<id> <ip>:<port>@<bus> slave ..."
        while _role(replica_port).get("master_link_status") != "up":
            assert time.time() < deadline, "the replica never synced"
            time.sleep(0.1)
        merged_before = cluster.llen(state.k + "merges")
        assert redis.Redis(port=replica_port).execute_command("CLUSTER FAILOVER") in (b"OK", "OK", True)
        while _role(replica_port)["role"] != "master":
            assert time.time() < deadline, "the replica was not promoted"
            time.sleep(0.1)
    finally:
        runner.join(timeout=600)
    assert _role(master.port)["role"] == "slave"                       # the old master follows it now
    s = result["s"]
    c = s["contributions"]
    assert c["applied_twice"] == 0 and c["pending"] == 0 and c["rejected"] == 0, c
    assert c["published"] == c["applied"] == c["accepted"] > 0
    assert len(SyncerState(connect(cfg.state), cfg.state.key_prefix, run_id).merges()) > merged_before  # merged on after it
    assert_exact_accounting(cfg, run_id)
