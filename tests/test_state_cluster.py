"""The syncer's Redis state on one server and on a real three-master Redis Cluster: a run's keys
share one hash slot, so its transactions, scripts and MGET work on either."""

from __future__ import annotations

import json
import time

import pytest
from redis.cluster import RedisCluster
from redis.crc import key_slot
from rich.console import Console

from diloco.config import build_config
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
