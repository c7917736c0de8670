"""Sharded syncer: fragment ownership through Redis leases, fencing of stale owners in Redis and in
TensorStore, takeover and hand-back between shard processes."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections import Counter

import numpy as np
import pytest
from helpers import Harness, assert_exact_accounting, run_events
from rich.console import Console

from diloco.config import ConfigError, build_config, dump_config
from diloco.infra.store import FragmentStore, StoreFenced
from diloco.run import child_env, train
from diloco.syncer import shards
from diloco.syncer.state import Fenced, SyncerState, connect


# --- ownership, pure -------------------------------------------------------------------------
@pytest.mark.parametrize("live", [{0, 1, 2}, {0, 2}, {1}, {0, 1}, set()])
def test_every_fragment_has_exactly_one_owner(live):
    n, fragments = 3, 8
    owners = {p: shards.owner_of(p, n, live) for p in range(fragments)}
    for p, owner in owners.items():
        assert owner in (live or {shards.home_shard(p, n)})
        if shards.home_shard(p, n) in live:
            assert owner == shards.home_shard(p, n)   # a live home keeps its fragments: no churn
    claimed = [p for s in range(n) for p in shards.wanted(s, fragments, n, live) if s in live]
    assert sorted(claimed) == sorted(p for p in range(fragments) if owners[p] in live)


def test_a_shard_owns_whole_fragments():
    with pytest.raises(ConfigError, match=r"syncer.shards \(5\) exceeds fragments.count \(4\)"):
        build_config({"syncer": {"shards": 5}, "fragments": {"count": 4}})
    assert build_config({"syncer": {"shards": 3}}).syncer_ids() == ["syncer-0", "syncer-1", "syncer-2"]
    assert build_config({}).syncer_ids() == ["syncer"]


def test_a_dead_shards_fragments_are_spread_over_the_live_ones():
    orphans = [p for p in range(12) if shards.home_shard(p, 3) == 1]
    fosters = Counter(shards.owner_of(p, 3, {0, 2}) for p in orphans)
    assert set(fosters) == {0, 2} and max(fosters.values()) - min(fosters.values()) <= 1


# --- fencing in Redis and TensorStore ---------------------------------------------------------
@pytest.mark.integration
def test_a_claim_fences_the_previous_owners_writes(tiny_config):
    cfg = tiny_config()
    h = Harness(cfg, f"fence-{time.time_ns() % 10**6}", in_process=False)
    st = h.state
    first, _ = st.claim(0, shard=0, member="0:a", ttl_s=0.3)
    assert first and st.claim(0, shard=1, member="1:b", ttl_s=0.3) == (0, "0:a")  # held by another shard
    time.sleep(0.4)                                                           # shard 0 stalls past its TTL
    second, previous = st.claim(0, shard=1, member="1:b", ttl_s=5)
    assert (second, previous) == (first + 1, "0:a") and not st.renew(0, "0:a", 5)
    with pytest.raises(Fenced) as err:
        st.accept(0, "c-stale", {"id": "c-stale"}, {}, fence={0: first})
    assert err.value.fragment == 0 and "another shard owns it" in str(err.value)
    with pytest.raises(Fenced):
        st.commit_merge(0, from_version=0, ids=[], late=0, record={}, offsets={}, sync_time_s=0.0, fence={0: first})
    assert "c-stale" not in st.statuses() and st.versions()[0] == 0           # nothing of it landed
    st.accept(0, "c-new", {"id": "c-new"}, {}, fence={0: second})
    st.commit_merge(0, from_version=0, ids=["c-new"], late=0, record={}, offsets={}, sync_time_s=0.0,
                    fence={0: second})
    assert st.versions()[0] == 1 and st.statuses()["c-new"] == "applied:0:1"
    assert st.claim(0, shard=1, member="1:c", ttl_s=5) == (second + 1, "1:b")  # a restarted incarnation of
    assert st.lease_holder(0) == "1:c"                                        # the same shard takes over at once


@pytest.mark.integration
@pytest.mark.parametrize("where", ["file", "gs"])
def test_a_stale_owner_cannot_replace_a_newer_version_in_tensorstore(where, tmp_path, request):
    url = f"file://{tmp_path}/store" if where == "file" else request.getfixturevalue("gcs_emulator")
    store = FragmentStore(url, f"fence-{where}-{time.time_ns() % 10**6}")
    new, old = {"w": np.full((2, 3), 2.0, np.float32)}, {"w": np.full((2, 3), 1.0, np.float32)}
    store.write(0, 1, old, {}, {"who": "orphan of a crashed owner"}, epoch=1)
    store.write(0, 1, new, {}, {"who": "new owner"}, epoch=2)                # a newer epoch replaces the orphan
    with pytest.raises(StoreFenced, match="written by epoch 2; this writer holds epoch 1"):
        store.write(0, 1, old, {}, {"who": "stale owner"}, epoch=1)
    got = store.read(0, 1)
    assert got.meta["who"] == "new owner" and got.meta["epoch"] == 2
    np.testing.assert_array_equal(got.params["w"], new["w"])                 # its arrays were not touched
    retry = {"w": np.full((2, 3), 3.0, np.float32)}
    store.write(0, 1, retry, {}, {"who": "new owner, retried"}, epoch=2)     # the owner retries: it overwrites
    got = store.read(0, 1)
    assert got.meta["who"] == "new owner, retried"
    np.testing.assert_array_equal(got.params["w"], retry["w"])


@pytest.mark.integration
def test_a_stalled_shard_loses_its_fragments_and_its_late_merge_is_refused(tiny_config):
    cfg = tiny_config(syncer={"shards": 2, "lease_ttl_s": 1.0, "quorum": 3, "grace_max_s": 0.0, "stuck_after_s": 1.0})
    h = Harness(cfg, f"stall-{time.time_ns() % 10**6}", in_process=False)
    a, b = h.new_syncer(shard=0), h.new_syncer(shard=1)
    assert set(a.fragments) == {0, 2} and set(b.fragments) == {1, 3}         # homes: p % 2
    first = h.publish("us-0", fragment=1)
    h.publish("eu-0", fragment=1)
    h.syncer = b
    h.pump(lambda: len(b.fragments[1].round) == 2 and all(c.deltas is not None for c in b.fragments[1].round.values()))
    stale_epoch = b.ownership.epochs[1]
    h.syncer = a                                                              # b stalls; a keeps going
    h.pump(lambda: {1, 3} <= set(a.fragments), timeout=10)
    assert a.ownership.epochs[1] == stale_epoch + 1
    h.publish("us-1", fragment=1)                                             # the round's quorum arrives
    h.pump(lambda: h.state.versions()[1] == 1)                                # a merges b's accepted round
    with pytest.raises(Fenced):
        b.merge(1, reason="late")                                             # b wakes up and tries the same
    assert h.state.versions()[1] == 1 and h.state.statuses()[first.id] == "applied:1:1"
    assert [(m["fragment"], len(m["ids"])) for m in h.state.merges()] == [(1, 3)]
    assert FragmentStore(cfg.store.url, h.run_id).read_meta(1, 1)["epoch"] == a.ownership.epochs[1]
    b.every_lease.reset()
    b.rebalance()                                                             # renewing fails: b lets go
    assert 1 not in b.fragments
    deadline = time.time() + 15
    while not (set(a.fragments) == {0, 2} and set(b.fragments) == {1, 3}):    # b is live: a hands back
        assert time.time() < deadline, (set(a.fragments), set(b.fragments))
        a.step()
        b.step()


@pytest.mark.integration
def test_a_long_step_keeps_its_leases_and_a_second_process_of_a_shard_stands_by(tiny_config):
    cfg = tiny_config(syncer={"shards": 2, "lease_ttl_s": 1.0, "quorum": 3, "grace_max_s": 0.0})
    h = Harness(cfg, f"busy-{time.time_ns() % 10**6}", in_process=False)
    a, b = h.new_syncer(shard=0), h.new_syncer(shard=1)
    deadline = time.time() + 4.0                   # a is busy for four lease TTLs (a long merge, say)
    while time.time() < deadline:
        b.step()
    a.step()
    assert set(a.fragments) == {0, 2} and set(b.fragments) == {1, 3}
    started = []
    second = threading.Thread(target=lambda: started.append(h.new_syncer(shard=0)), daemon=True)
    second.start()                                 # another process of shard 0, while a is live
    deadline = time.time() + 3.0
    while time.time() < deadline:
        a.step()
        b.step()
    assert second.is_alive() and not started and set(a.fragments) == {0, 2}
    a.close()                                      # a goes: the one standing by takes its place
    second.join(timeout=15)
    assert started, "the standby never took over"
    deadline = time.time() + 10
    while set(started[0].fragments) != {0, 2}:
        assert time.time() < deadline, set(started[0].fragments)
        started[0].step()
        b.step()
    started[0].close()
    b.close()


# --- shard processes ---------------------------------------------------------------------------
@pytest.mark.integration
def test_syncer_cli_runs_n_shards_and_hands_everything_back_on_sigterm(tiny_config, tmp_path):
    run_id = f"cli-shards-{time.time_ns() % 10**6}"
    cfg = tiny_config(run={"id": run_id}, syncer={"lease_ttl_s": 2.0})
    h = Harness(cfg, run_id, in_process=False)
    conf = tmp_path / "config.yaml"
    conf.write_text(dump_config(cfg))
    bad = subprocess.run([sys.executable, "-m", "diloco", "syncer", "-c", str(conf), "--shard", "2"],
                         capture_output=True, text=True, env=child_env(cfg))
    assert bad.returncode == 2 and "--shard 2 is not in 0..0" in bad.stderr
    proc = subprocess.Popen([sys.executable, "-m", "diloco", "syncer", "-c", str(conf), "--shards", "2"],
                            env=child_env(cfg), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 90
        while len(started := [e for e in h.events() if e["kind"] == "syncer_started"]) < 2:
            assert time.time() < deadline and proc.poll() is None, "the shards did not start"
            time.sleep(0.5)
        assert sorted((e["shard"], tuple(e["fragments"])) for e in started) == [(0, (0, 2)), (1, (1, 3))]
        holders = {p: h.state.lease_holder(p).split(":")[0] for p in range(4)}
        assert holders == {0: "0", 1: "1", 2: "0", 3: "1"}                    # each at its home shard
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    assert rc == 0
    assert all(h.state.lease_holder(p) is None for p in range(4))             # released, not left to expire
    assert h.state.live_shards(2) == set()


@pytest.mark.integration
def test_three_shards_survive_one_killed_and_rebalance_when_it_returns(tiny_config, tmp_path):
    ttl = 1.5
    # ~30 s of training: the killed shard is down for a few seconds early on and back well before the end
    cfg = tiny_config(inner={"steps": 300}, fragments={"count": 6, "sync_every": 20, "chunk_bytes": 4096},
                      regions=[{"name": "us", "learners": 2, "speed": 0.1}, {"name": "eu", "learners": 2, "speed": 0.1}],
                      syncer={"shards": 3, "lease_ttl_s": ttl, "incomplete_timeout_s": 5.0},
                      chaos={"seed": 3, "learner_kills": 0, "syncer_kills": 1, "restart_after_s": 3 * ttl,
                             "window": [0.15, 0.25]})
    s = train(cfg, progress=False, console=Console(quiet=True), with_chaos=True, summary_json=tmp_path / "s.json")
    (killed, n), = s["kills"].items()
    assert killed.startswith("syncer-") and n == 1 and s["restarts"] == {killed: 1}
    home = int(killed.split("-")[1])
    orphans = {p for p in range(6) if shards.home_shard(p, 3) == home}
    events = list({e["eid"]: e for e in run_events(cfg, s["run_id"])}.values())
    claims = sorted((e for e in events if e["kind"] == "fragment_claimed"), key=lambda e: e["time"])
    taken = [t for t in s["takeovers"] if t["from"] == killed]
    assert {t["fragment"] for t in taken} == orphans                         # the live shards took them over
    assert all(t["to"] != killed and t["after_s"] <= ttl + 2.0 for t in taken)
    back = [e for e in claims if e["shard"] == home and e["previous"] and not e["previous"].startswith(f"{home}:")]
    assert {e["fragment"] for e in back} == orphans                          # and handed them back after its restart
    kill_at = min(e["time"] for e in claims if e["fragment"] in orphans and e["shard"] != home)
    state = SyncerState(connect(cfg.state), cfg.state.key_prefix, s["run_id"])
    merges = state.merges()
    assert Counter((m["fragment"], m["version"]) for m in merges).most_common(1)[0][1] == 1  # no round twice
    for p in range(6):  # every fragment kept advancing while its home was down and after
        assert any(m["fragment"] == p and m["time"] > kill_at for m in merges), p
    c = s["contributions"]
    assert c["applied_twice"] == 0 and c["pending"] == 0 and c["published"] == c["applied"] + c["rejected"]
    assert set(s["rejections"]) <= {"incomplete"}
    assert s["eval_loss_end"] < 0.9 * s["eval_loss_start"]
    assert_exact_accounting(cfg, s["run_id"])
