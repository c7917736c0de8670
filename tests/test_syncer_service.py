"""The syncer in-process against the real broker, Redis and TensorStore, fed crafted contributions."""

from __future__ import annotations

import time

import numpy as np
import pytest
from helpers import Harness

from diloco import messages, quantize
from diloco.infra import kafka as kafka_io
from diloco.infra.store import stored_update_bytes
from diloco.learners.fetcher import Fetcher
from diloco.learners.publisher import Counters
from diloco.syncer import merge as merge_math

pytestmark = pytest.mark.integration


@pytest.fixture
def harness(tiny_config, request):
    cfg = tiny_config(syncer={"quorum": 2, "grace_max_s": 0.0, "max_staleness": 1, "norm_outlier_factor": 0,
                              "scale_partial_rounds": True})
    h = Harness(cfg, f"svc-{request.node.name[:30].replace('_', '-')}-{time.time_ns() % 10**6}")
    yield h
    h.producer.close()


def test_quorum_merge_matches_rda_and_nesterov_by_hand(harness):
    h = harness
    d0, d1 = h.deltas(0, seed=1), h.deltas(0, seed=2)
    a = h.publish("us-0", 0, deltas=d0, tokens=1000, steps=4)
    h.pump(lambda: h.state.counters().get("accepted") == 1)
    assert h.state.versions()[0] == 0                      # below quorum: waits
    b = h.publish("eu-1", 0, deltas=d1, tokens=700, steps=4)  # within syncer.tokens_per_step_spread (1.5)
    h.pump(lambda: h.state.versions()[0] == 1)

    w = merge_math.token_weights([1000, 700], [4, 4])
    v0 = h.store.read(0, 0)
    opt = merge_math.outer_optimizer(h.cfg.outer.lr, h.cfg.outer.momentum, h.cfg.outer.nesterov)
    merged = merge_math.merge_deltas([d0, d1], w, h.run_plan.mean_merged)
    merged = {n: 0.5 * d for n, d in merged.items()}  # 2 of the 4 learners: half a full round's step
    stepped, _ = merge_math.outer_step(opt, v0.params, opt.init(v0.params), merged)
    wire, expect, residual = quantize.encode_update(v0.params, stepped, {}, h.cfg.syncer.broadcast)
    got = h.store.read(0, 1)
    for n in expect:
        np.testing.assert_allclose(got.params[n], expect[n], rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(h.syncer.fragments[0].residual[n], residual[n], atol=1e-7)
    # learners holding v0 fetch the encoded update and hold v1 bit for bit
    scheme, update, read = h.store.read_update(0, 1)
    assert scheme == h.cfg.syncer.broadcast == "int8" and {n: len(b) for n, b in update.items()} == {
        n: len(b) for n, b in wire.items()}  # the codes, unpacked
    # the syncer's fused path and this numpy reference may round a per-row scale one ulp apart (the
    # SIMD kernels numpy picks depend on the CPU), so the codes agree as values, not byte for byte
    ours, reference = quantize.apply_update(v0.params, update, scheme), quantize.apply_update(v0.params, wire, scheme)
    for n in reference:
        np.testing.assert_allclose(ours[n], reference[n], rtol=1e-5, atol=1e-7)
    info = h.store.read_meta(0, 1)["update"]
    assert h.cfg.syncer.broadcast_packing == "zstd" and "zstd" in info["packing"].values()
    assert read == sum(info["stored"].values()) < sum(len(b) for b in wire.values())  # zstd took some off
    for n, held in quantize.apply_update(v0.params, update, scheme).items():
        np.testing.assert_array_equal(held, got.params[n])
    assert got.meta["ids"] == [b.id, a.id] and got.meta["tokens"] == 1700 and got.meta["share"] == 0.5  # by learner
    assert h.store.versions(0) == [0, 1]
    merges = [e for e in h.events() if e["kind"] == "merge"]
    assert [(e["fragment"], e["version"], e["ids"]) for e in merges] == [(0, 1, [b.id, a.id])]
    announced = kafka_io.read_to_end(h.cfg.transport, kafka_io.partitions_of(h.topics.outer, 1))
    assert {"fragment": 0, "version": 1} in [{k: messages.parse_event(r.value)[k] for k in ("fragment", "version")}
                                              for r in announced]


def test_bad_contributions_are_rejected_with_reasons_and_the_syncer_carries_on(harness):
    h = harness
    frag_shape_wrong = {n: np.zeros((3, 3), np.float32) for n in h.plan[1]}
    nan = h.deltas(2)
    nan[next(iter(nan))].flat[0] = np.nan
    h.raw("us", b"garbage that is not a frame")
    h.publish("us-0", 1, deltas=frag_shape_wrong)
    h.publish("us-0", 2, deltas=nan)
    h.publish("xx-9", 0, region="us")                                      # unknown learner
    h.publish("us-0", 0, run="another-run")
    h.publish("us-0", 3, base_version=5)                                   # from the future
    h.publish("us-1", 3, frames_filter=lambda fs: fs[:1] + [fs[1][:-1] + b"!"] + fs[2:])  # corrupted chunk
    h.pump(lambda: h.state.counters().get("rejected_records", 0) + h.state.counters().get("rejected", 0) >= 7)
    c = h.state.counters()
    assert {k: v for k, v in c.items() if k.startswith("rejected:")} == {
        "rejected:malformed": 1, "rejected:wrong_shape": 1, "rejected:non_finite": 1, "rejected:unknown_learner": 1,
        "rejected:wrong_run": 1, "rejected:future_version": 1, "rejected:checksum": 1}
    reasons = {e["reason"]: e for e in h.events() if e["kind"] == "contribution_rejected"}
    assert reasons["malformed"]["where"]["offset"] == 0 and "not a diloco frame" in reasons["malformed"]["detail"]
    assert "non-finite" in reasons["non_finite"]["detail"]
    # still healthy: a good round merges afterwards
    h.publish("us-0", 0)
    h.publish("eu-0", 0)
    h.pump(lambda: h.state.versions()[0] == 1)
    assert h.state.versions() == {0: 1, 1: 0, 2: 0, 3: 0}


def test_stale_and_late_contributions(harness):
    h = harness
    h.publish("us-0", 0)
    h.publish("us-1", 0)
    h.pump(lambda: h.state.versions()[0] == 1)
    h.publish("eu-0", 0)
    h.publish("eu-1", 0, base_version=1)
    h.pump(lambda: h.state.versions()[0] == 2)                # base 0 at version 1: late, but merged
    assert h.state.counters()["late"] == 1
    h.publish("us-0", 0, base_version=0)                      # now 2 versions behind, max_staleness 1
    h.pump(lambda: h.state.counters().get("rejected:stale") == 1)


def test_learners_fetch_compact_updates_and_hold_the_exact_global(harness):
    h = harness
    h.rounds(3)
    fetcher = Fetcher(h.cfg, h.run_id, None, h.store, h.topics, Counters(), h.run_plan)
    whole = {n: [tuple((0, s) for s in shape)] for n, shape in h.run_plan.shapes.items()}
    fetcher.want(whole)
    got = fetcher.fetch(0, 0)                                      # nothing held: the whole fragment
    v0, whole_bytes = got.whole, got.nbytes
    assert whole_bytes == sum(a.nbytes for a in v0.values())
    fetcher.held[0] = (0, v0)
    got = fetcher.fetch(0, 3)                                      # one int8 update from the snapshot v0,
    v3, update_bytes = got.whole, got.nbytes
    for n, (base, update) in got.made_of().items():                # which a learner keeps instead of v3
        assert base is v0[n] and update.scheme == "int8"
        np.testing.assert_array_equal(quantize.apply_update({n: base}, {n: update.data}, "int8")[n], v3[n])
    stored = h.store.read(0, 3)                                    # however many versions came between
    for n, a in stored.params.items():
        np.testing.assert_array_equal(v3[n], a)
    per_update = stored_update_bytes(h.store.read_meta(0, 3))  # as stored: packed
    codes = sum(quantize.encoded_nbytes(a.shape, "int8") for a in v0.values())
    assert update_bytes == per_update < codes < 0.3 * whole_bytes  # under 1 byte per parameter, not 4
    assert h.store.read_meta(0, 3)["update"]["from"] == 0
    # v3 is not a snapshot (store.snapshot_every 8): the store holds its update only, yet a restart
    # rebuilds the exact state, the quantization error not published yet included, by replaying the
    # merges since v0 from the log
    assert h.store.read_meta(0, 3)["snapshot"] is False and stored.residual == {} and stored.opt == {}
    live = h.syncer.fragments[0]
    assert any(np.any(r != 0) for r in live.residual.values())
    rebuilt = h.syncer.rebuild_fragment(0, 3)
    assert rebuilt.version == 3 and rebuilt.snapshot_at == 0
    for group in ("params", "residual"):
        for n, a in getattr(live, group).items():
            np.testing.assert_array_equal(getattr(rebuilt, group)[n], a, err_msg=f"{group}/{n}")
    for n, a in merge_math.flatten_state(live.opt_state).items():
        np.testing.assert_array_equal(merge_math.flatten_state(rebuilt.opt_state)[n], a, err_msg=n)
    again = fetcher.fetch(0, 3)                                    # the snapshot v0 is kept: 1 update again
    again, nbytes = again.whole, again.nbytes
    assert nbytes == update_bytes and fetcher.snapshots[0][0] == 0
    fetcher.held.pop(0), fetcher.snapshots.pop(0)                  # nothing held: snapshot v0 + 1 update
    again = fetcher.fetch(0, 3)
    again, nbytes = again.whole, again.nbytes
    assert nbytes == whole_bytes + update_bytes and all(np.array_equal(again[n], v3[n]) for n in v3)
    # a host holding half of each tensor (sharded across hosts) reads that half, fp32, and no more
    halves = {n: [((0, s[0] // 2), *((0, d) for d in s[1:]))] for n, s in h.run_plan.shapes.items() if s[0] % 2 == 0}
    fetcher.want({**whole, **halves})
    got = fetcher.fetch(0, 3)
    blocks, held_whole, half_bytes = got.blocks, got.whole, got.nbytes
    assert got.made_of() == {}                                     # a part of a tensor: its anchor is kept as it is
    names = h.plan[0]
    assert held_whole is None and set(blocks) == set(names)
    for n in names:
        (r,) = fetcher.blocks[n]
        np.testing.assert_array_equal(blocks[n][r], stored.params[n][tuple(slice(a, b) for a, b in r)])
    assert half_bytes == sum(blocks[n][fetcher.blocks[n][0]].nbytes for n in names) < 0.6 * whole_bytes


@pytest.mark.parametrize("update_base", ["snapshot", "previous"])
def test_a_learner_crosses_snapshots_by_their_updates_and_reaches_every_version_exactly(tiny_config, tmp_path,
                                                                                      update_base):
    """With a snapshot every 2 versions and syncer.update_base=snapshot each update is relative to
    the snapshot before it: a fetcher holding v1 reaches v5 through the updates of v2 and v4
    (snapshots) and v5, v4 becomes its base, and from there v7 costs the updates of v6 and v7. With
    update_base=previous every version's update is from the one before (one per version). Every
    version read equals the stored one bit for bit, and a rebuild replays against the right base."""
    cfg = tiny_config(syncer={"quorum": 2, "grace_max_s": 0.0, "norm_outlier_factor": 0, "update_base": update_base,
                              "broadcast_packing": "none"},  # every link the same bytes, so links are counted
                      store={"url": f"file://{tmp_path}/snapshots", "snapshot_every": 2})
    h = Harness(cfg, f"snap-{time.time_ns() % 10**8}")
    try:
        h.rounds(7)
        froms = [h.store.read_meta(0, v)["update"]["from"] for v in range(1, 8)]
        assert froms == ([0, 0, 2, 2, 4, 4, 6] if update_base == "snapshot" else [0, 1, 2, 3, 4, 5, 6])
        fetcher = Fetcher(h.cfg, h.run_id, None, h.store, h.topics, Counters(), h.run_plan)
        fetcher.want({n: [tuple((0, s) for s in shape)] for n, shape in h.run_plan.shapes.items()})
        v0, _ = h.store.read_params(0, 0)
        fetcher.start_from(0, 0, v0, ready=False)
        per_update = sum(quantize.encoded_nbytes(a.shape, "int8") for a in v0.values())
        steps = ((1, 1, 0), (5, 3, 4), (7, 2, 6)) if update_base == "snapshot" else ((1, 1, 0), (5, 4, 4), (7, 2, 6))
        for v, links, base in steps:
            fetched = fetcher.fetch(0, v)
            got, nbytes = fetched.whole, fetched.nbytes
            fetcher.held[0] = (v, got)
            assert nbytes == links * per_update and fetcher.snapshots[0][0] == base, v
            for n, a in h.store.read(0, v).params.items():
                np.testing.assert_array_equal(got[n], a, err_msg=f"v{v} {n}")
        live = h.syncer.fragments[0]
        assert live.snapshot_at == 6 and live.update_from() == (6 if update_base == "snapshot" else 7)
        rebuilt = h.syncer.rebuild_fragment(0, 7)
        assert rebuilt.update_from() == live.update_from()
        for n, a in live.residual.items():
            np.testing.assert_array_equal(rebuilt.residual[n], a, err_msg=n)
    finally:
        h.producer.close()


def test_replayed_records_are_not_applied_twice_after_restart(harness):
    h = harness
    a = h.publish("us-0", 0)
    b = h.publish("us-1", 0)
    h.pump(lambda: h.state.versions()[0] == 1)
    c = h.publish("eu-0", 1)                                  # pending in fragment 1's round
    h.pump(lambda: h.state.counters().get("accepted") == 3)
    h.syncer.save_offsets(force=True)
    h.syncer.consumer.close()

    # The broker redelivers everything (as after a restart of an in-memory broker).
    for m_id in (a.id, b.id):
        assert h.state.statuses()[m_id].startswith("applied")
    h.syncer = h.new_syncer()
    assert h.syncer.fragments[1].round[c.id].deltas is None   # known from Redis, payload replays from Kafka
    again = h.publish("eu-1", 1)
    h.pump(lambda: h.state.versions()[1] == 1)
    assert h.store.read(1, 1).meta["ids"] == [c.id, again.id]
    before = h.state.counters().get("duplicate_records", 0)
    n = h.resend(a.id) + h.resend(c.id)                       # the very same records again
    h.pump(lambda: h.state.counters().get("duplicate_records", 0) == before + n)
    ids = [cid for m in h.state.merges() for cid in m["ids"]]
    assert len(ids) == len(set(ids)) == 4
    assert h.state.counters()["applied"] == 4


def test_truncated_unknown_fragment_and_inf_are_rejected(tiny_config):
    cfg = tiny_config(syncer={"quorum": 2, "incomplete_timeout_s": 5.0})
    h = Harness(cfg, f"svc-bad2-{time.time_ns() % 10**6}")
    now = [time.time()]
    t0 = now[0]
    h.syncer.clock = lambda: now[0]
    inf = h.deltas(1)
    inf[next(iter(inf))].flat[-1] = np.inf
    h.publish("us-0", 0, deltas={n: np.zeros((3,), np.float32) for n in h.plan[0]})
    h.publish("us-1", 1, deltas=inf)
    cut = h.publish("eu-0", 2, frames_filter=lambda fs: fs[:-1])              # last chunk never arrives
    h.publish("eu-1", 9, deltas=h.deltas(3))                                   # no fragment 9
    h.pump(lambda: h.state.counters().get("rejected", 0) >= 3)
    assert h.state.counters().get("rejected:incomplete") is None

    def later():                      # a reading syncer's clock: 0.5 s per step, its partition read to the end
        now[0] += 0.5
        return h.state.counters().get("rejected:incomplete") == 1
    h.pump(later)
    assert now[0] - t0 > 5.0                                                   # not before incomplete_timeout_s
    c = h.state.counters()
    assert {k: v for k, v in c.items() if k.startswith("rejected:")} == {
        "rejected:wrong_shape": 1, "rejected:non_finite": 1, "rejected:unknown_fragment": 1, "rejected:incomplete": 1}
    assert h.state.statuses()[cut.id] == "rejected:incomplete"


def test_manifest_over_the_size_limit_is_rejected_before_its_chunks_arrive(tiny_config):
    cfg = tiny_config(syncer={"max_contribution_bytes": 4096})
    h = Harness(cfg, f"svc-big-{time.time_ns() % 10**6}")
    m = h.publish("us-0", 0, frames_filter=lambda fs: fs[:1])                 # the manifest alone
    h.pump(lambda: h.state.counters().get("rejected:oversized") == 1)
    before = h.state.counters().get("duplicate_records", 0)
    n = h.resend(m.id)                                                         # its chunks come later
    h.pump(lambda: h.state.counters().get("duplicate_records", 0) == before + n)
    assert h.state.counters()["rejected"] == 1


def test_a_rebuild_without_its_contributions_keeps_exact_parameters_and_says_so(harness):
    h = harness
    h.rounds(2)
    key = h.state.k + "merges"
    records = [__import__("json").loads(r) for r in h.state.r.lrange(key, 0, -1)]
    for i, rec in enumerate(records):          # as if the log had dropped them (retention)
        if rec["fragment"] == 0 and rec["version"] == 2:
            rec["ids"] = [f"expired-{i}" for i in range(len(rec["ids"]))]
            h.state.r.lset(key, i, __import__("json").dumps(rec))
    live = h.syncer.fragments[0]
    rebuilt = h.syncer.rebuild_fragment(0, 2)
    for n, a in live.params.items():           # the parameters come from the updates: exact
        np.testing.assert_array_equal(rebuilt.params[n], a)
    assert rebuilt.residual == {} and rebuilt.version == 2
    h.syncer.outbox.relay()
    ev = [e for e in h.events() if e["kind"] == "fragment_state_approximate"]
    assert ev and ev[-1]["fragment"] == 0 and ev[-1]["snapshot"] == 0 and "no longer in the log" in ev[-1]["reason"]


def test_a_stale_contribution_is_discounted_and_momentum_decays_per_full_round(tiny_config):
    """syncer.staleness_discount and outer.momentum_per_round: a round of a fresh and a one-version-late
    delta merges as the pure functions say, and a rebuild from the snapshot replays it bit for bit."""
    cfg = tiny_config(syncer={"quorum": 2, "grace_max_s": 0.0, "max_staleness": 2, "norm_outlier_factor": 0,
                              "scale_partial_rounds": True, "staleness_discount": 1.0},
                      outer={"lr": 0.7, "momentum": 0.9, "nesterov": True, "momentum_per_round": True})
    h = Harness(cfg, f"svc-stale-{time.time_ns() % 10**6}")
    d = [h.deltas(0, seed=s) for s in range(4)]
    h.publish("us-0", 0, deltas=d[0], tokens=512, steps=2)
    h.publish("us-1", 0, deltas=d[1], tokens=512, steps=2)
    h.pump(lambda: h.state.versions()[0] == 1)
    h.publish("eu-0", 0, base_version=0, deltas=d[2], tokens=512, steps=2)   # trained on v0: one version late
    h.publish("eu-1", 0, base_version=1, deltas=d[3], tokens=512, steps=2)
    h.pump(lambda: h.state.versions()[0] == 2)

    opt0 = merge_math.outer_optimizer(0.7, merge_math.round_momentum(0.9, 0.5), True)  # 0.9 ** 0.5 per half round
    v0 = h.store.read(0, 0).params
    half = lambda m: {n: 0.5 * x for n, x in m.items()}  # noqa: E731 - 2 of 4 learners: half a round
    w1 = merge_math.token_weights([512, 512], [2, 2])
    _, state = merge_math.outer_step(opt0, v0, opt0.init(v0), half(merge_math.merge_deltas(d[:2], w1, h.run_plan.mean_merged)))
    w2 = merge_math.staleness_weights(w1, [1, 0], 1.0)   # eu-0 (late) then eu-1, the merge's canonical order
    np.testing.assert_allclose(w2, [1 / 3, 2 / 3])
    v1 = h.store.read(0, 1).params
    p2, state = merge_math.outer_step(opt0, v1, state, half(merge_math.merge_deltas([d[2], d[3]], w2, h.run_plan.mean_merged)))
    got = h.store.read(0, 2)
    assert got.meta["base_versions"] == [0, 1] and got.meta["weights"] == [round(float(w), 6) for w in w2]
    live = h.syncer.fragments[0]
    for n in p2:  # the published values are an int8-encoded step from v1: within two codes of the exact step
        np.testing.assert_allclose(got.params[n], p2[n], atol=2 * np.abs(p2[n] - v1[n]).max() / 127 + 1e-7)
        np.testing.assert_allclose(live.opt_state[0].trace[n], state[0].trace[n], rtol=1e-5, atol=1e-8)
    rebuilt = h.syncer.rebuild_fragment(0, 2)
    for n in live.params:
        np.testing.assert_array_equal(rebuilt.params[n], live.params[n])
        np.testing.assert_array_equal(rebuilt.opt_state[0].trace[n], live.opt_state[0].trace[n])
    h.syncer.outbox.relay()
    assert not [e for e in h.events() if e["kind"] == "fragment_state_approximate"]
    h.producer.close()


@pytest.mark.parametrize("fresh_only", [False, True])
def test_late_deltas_wait_for_fresh_ones_with_quorum_of_fresh(tiny_config, fresh_only):
    """syncer.quorum_of_fresh: two deltas one version late are a quorum of K = 2 by themselves
    without it, and wait for the next fresh ones with it, so that the round that merges them also
    holds deltas trained from the current version (where staleness_discount can weigh them)."""
    cfg = tiny_config(syncer={"quorum": 2, "grace_max_s": 0.0, "max_staleness": 2, "norm_outlier_factor": 0,
                              "quorum_of_fresh": fresh_only})
    h = Harness(cfg, f"svc-fresh-{int(fresh_only)}-{time.time_ns() % 10**6}")
    h.publish("us-0", 0, deltas=h.deltas(0, seed=0))
    h.publish("us-1", 0, deltas=h.deltas(0, seed=1))
    h.pump(lambda: h.state.versions()[0] == 1)
    late = [h.publish(lrn, 0, base_version=0, deltas=h.deltas(0, seed=s)).id for lrn, s in (("eu-0", 2), ("eu-1", 3))]
    h.pump(lambda: h.state.counters().get("accepted") == 4)
    for _ in range(20):  # with no grace window a round that may close closes at the next step
        h.syncer.step()
    if not fresh_only:
        assert h.state.versions()[0] == 2 and sorted(h.store.read(0, 2).meta["ids"]) == sorted(late)
        return
    assert h.state.versions()[0] == 1 and sorted(h.syncer.fragments[0].round) == sorted(late)
    fresh = [h.publish(lrn, 0, base_version=1, deltas=h.deltas(0, seed=s)).id for lrn, s in (("us-0", 4), ("us-1", 5))]
    h.pump(lambda: h.state.versions()[0] == 2)
    meta = h.store.read(0, 2).meta
    assert sorted(meta["ids"]) == sorted(late + fresh) and meta["base_versions"] == [0, 0, 1, 1] and meta["late"] == 2
    h.producer.close()


def test_a_dropped_learner_stays_dropped_after_a_restart_and_a_silent_member_ages_out(tiny_config):
    """Dropped learners used to come back as permanent ghosts after any reload: counted live and
    present (never heard from), so with K = 2 and one real learner left no round closed again."""
    cfg = tiny_config(syncer={"quorum": 2, "grace_max_s": 0.0, "silent_after_s": 0.3, "drop_after_s": 0.6})
    h = Harness(cfg, f"svc-ghosts-{time.time_ns() % 10**6}")
    try:
        for lid in cfg.learner_ids():
            h.heartbeat(lid, step=1)
        h.pump(lambda: h.syncer.registry.live() == set(cfg.learner_ids()))
        deadline = time.time() + 20
        while time.time() < deadline:                           # only us-0 keeps beating
            h.heartbeat("us-0", step=2)
            h.syncer.step()
            if all(h.syncer.registry[lid]["status"] == "dropped" for lid in ("us-1", "eu-0", "eu-1")):
                break
            time.sleep(0.1)
        assert {lid for lid, hb in h.state.registry().items() if hb["status"] == "dropped"} == {"us-1", "eu-0", "eu-1"}
        h.syncer = h.new_syncer()                               # a restart reloads the registry
        assert h.syncer.registry.present() == {"us-0"} and h.syncer.registry.live() == {"us-0"}
        h.heartbeat("eu-0", step=3)                             # a dropped learner that comes back is live again
        h.pump(lambda: "eu-0" in h.syncer.registry.live())
    finally:
        h.producer.close()


def test_a_member_never_heard_from_ages_out_after_a_restart(tiny_config):
    cfg = tiny_config(syncer={"quorum": 2, "grace_max_s": 0.0, "silent_after_s": 0.3, "drop_after_s": 0.6})
    h = Harness(cfg, f"svc-unheard-{time.time_ns() % 10**6}")
    try:
        h.heartbeat("us-0", step=1)
        h.pump(lambda: "us-0" in h.syncer.registry)
        h.syncer = h.new_syncer()                               # us-1, eu-0, eu-1 never beat
        assert h.syncer.registry.live() == set(cfg.learner_ids())
        time.sleep(1.0)
        h.heartbeat("us-0", step=2)
        h.pump(lambda: h.syncer.registry.present() == {"us-0"})
    finally:
        h.producer.close()
