"""The benchmark harness at a tiny size, the merge options it needs (plain mean, equal weights) and
the WAN throttle arithmetic. Benchmarks themselves are not timed here."""

import json
import math
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import dp, ideal, merge_bench, metrics, report, runs, setups, sharded_bench
from diloco.config import ConfigError, TransformerOptions, TransportConfig, build_config
from diloco.learners.data import FORMAT, Corpus
from diloco.models.transformer import loss_fn
from diloco.plan import Plan, Tensor
from diloco.syncer import merge

# --- merge options -------------------------------------------------------------------------------


def test_token_weights_are_equal_when_weighting_is_off():
    np.testing.assert_allclose(merge.token_weights([1000, 10, 500], [10, 20, 5], weighted=False), [1 / 3] * 3)
    with pytest.raises(ValueError):
        merge.token_weights([10, 0], [1, 1], weighted=False)


def test_mean_rule_is_a_plain_weighted_mean_of_every_tensor():
    rng = np.random.default_rng(0)
    contribs = [{"a": rng.normal(size=(3, 4)).astype(np.float32), "tok_embed": rng.normal(size=5).astype(np.float32)}
                for _ in range(3)]
    w = np.array([0.2, 0.3, 0.5])
    out = merge.merge_deltas(contribs, w, ("tok_embed",), rule="mean")
    for name in ("a", "tok_embed"):
        np.testing.assert_allclose(out[name], sum(wi * c[name] for wi, c in zip(w, contribs)), rtol=1e-5)
    rda = merge.merge_deltas(contribs, w, ("tok_embed",))
    np.testing.assert_allclose(rda["a"], merge.rda([c["a"] for c in contribs], w), rtol=1e-6)
    assert not np.allclose(rda["a"], out["a"])
    with pytest.raises(ValueError, match="unknown merge rule"):
        merge.merge_deltas(contribs, w, rule="median")


def test_config_takes_the_merge_options_and_rejects_unknown_rules():
    cfg = build_config({"syncer": {"merge": "mean", "token_weighting": False}})
    assert (cfg.syncer.merge, cfg.syncer.token_weighting) == ("mean", False)
    assert (build_config({}).syncer.merge, build_config({}).syncer.token_weighting) == ("mean", True)
    assert build_config({"preset": "paper"}).syncer.merge == "rda"
    with pytest.raises(ConfigError, match="syncer.merge"):
        build_config({"syncer": {"merge": "median"}})


# --- WAN throttle --------------------------------------------------------------------------------


def test_wan_delay_is_latency_plus_bytes_over_the_share_of_the_link():
    t = TransportConfig(wan_bandwidth_mbps=8.0, wan_latency_ms=50.0)
    assert t.wan_delay_s(1_000_000) == pytest.approx(0.05 + 1.0)
    assert t.wan_delay_s(1_000_000, sharers=2) == pytest.approx(0.05 + 2.0)
    assert TransportConfig(wan_latency_ms=20.0).wan_delay_s(10**9) == pytest.approx(0.02)
    assert TransportConfig().wan_delay_s(10**9) == 0.0
    assert metrics.dp_comm_s(1_000_000, 8.0, 50.0, 2) == pytest.approx(t.wan_delay_s(1_000_000, sharers=2))


def test_dp_clock_charges_every_step_and_each_stall_once():
    clock = metrics.dp_clock(4, 1.0, 0.5, {2: 10.0})
    np.testing.assert_allclose(clock, [1.5, 3.0, 14.5, 16.0])


def test_dp_clock_takes_a_step_time_per_step_when_the_worker_count_changes():
    step_s = np.array([1.0, 1.0, 2.0, 2.0])       # 2 steps of 4 workers, then 2 of 8 that share the machine
    np.testing.assert_allclose(metrics.dp_clock(4, step_s, np.array([0.1, 0.1, 0.3, 0.3]), {3: 5.0}),
                               [1.1, 2.2, 4.5, 11.8])
    np.testing.assert_allclose(metrics.dp_clock(2, step_s[2:], 0.5, {}), [2.5, 5.0])


def test_dp_stalls_follow_the_seeded_learner_kills_only():
    cfg = setups.build("dp", "failures")
    stalls = runs.dp_stalls(cfg, 100, {"us-0": 7.0})
    assert sum(stalls.values()) == pytest.approx(7.0 + 3 * cfg.chaos.restart_after_s)  # 4 learners, syncer ignored
    assert all(0 <= s < 100 for s in stalls)


# --- figures -------------------------------------------------------------------------------------


def test_time_to_target_interpolates_and_is_inf_when_never_reached():
    assert metrics.time_to_target([0, 10, 20], [4.0, 3.0, 2.0], 2.5) == pytest.approx(15.0)
    assert metrics.time_to_target([0, 10], [4.0, 3.0], 4.5) == 0.0
    assert metrics.time_to_target([0, 10], [4.0, 3.0], 1.0) == math.inf
    assert metrics.gap_percent(1.02, 1.0) == pytest.approx(2.0)


def test_merge_stats_from_events():
    ev = [{"kind": "contribution_accepted", "id": "a", "bytes": 2_000_000, "time": 1.0},
          {"kind": "contribution_accepted", "id": "b", "bytes": 1_000_000, "time": 2.0},
          {"kind": "merge", "ids": ["a", "b"], "seconds": 0.5, "time": 3.0},
          {"kind": "contribution_accepted", "id": "c", "bytes": 1_000_000, "time": 3.0},
          {"kind": "merge", "ids": ["c"], "seconds": 0.5, "time": 3.5}]
    ev[2]["late"] = 1                                       # b was trained on an older version
    s = metrics.merge_stats(ev)
    assert (s["merges"], s["merged_mb"], s["merge_mb_per_s"]) == (2, 4.0, 4.0)
    assert (s["round_size"], s["late_share"]) == (1.5, pytest.approx(1 / 3))
    assert s["merge_s"]["p50"] == 0.5
    assert s["accept_to_merge_s"]["p50"] == pytest.approx(1.0)


def test_learner_time_and_tokens_from_heartbeats():
    beats = [{"kind": "heartbeat", "learner": "a", "incarnation": "1", "time": 12.0, "compute_s": 2.0, "tokens": 10,
              "step": 4},
             {"kind": "heartbeat", "learner": "a", "incarnation": "2", "time": 20.0, "compute_s": 3.0, "tokens": 30,
              "step": 10},
             {"kind": "heartbeat", "learner": "b", "incarnation": "1", "time": 15.0, "compute_s": 5.0, "tokens": 20,
              "step": 20}]
    lt = metrics.learner_time(beats, ["a", "b"])
    assert lt["origin"] == 10.0
    assert lt["compute_s"] == {"a": 5.0, "b": 5.0}
    assert lt["wall_s"] == {"a": 10.0, "b": 5.0}
    assert lt["step_s"] == {"a": 0.5, "b": 0.25}
    assert metrics.tokens_at(beats, 16.0) == 30


def test_time_at_tokens_and_step_time_in_a_window_from_heartbeats():
    beats = [{"kind": "heartbeat", "learner": "a", "incarnation": "1", "time": 1.0, "compute_s": 1.0, "tokens": 10,
              "step": 1},
             {"kind": "heartbeat", "learner": "b", "incarnation": "1", "time": 2.0, "compute_s": 2.0, "tokens": 10,
              "step": 1},
             {"kind": "heartbeat", "learner": "a", "incarnation": "1", "time": 3.0, "compute_s": 5.0, "tokens": 50,
              "step": 5},
             {"kind": "heartbeat", "learner": "a", "incarnation": "2", "time": 4.0, "compute_s": 1.0, "tokens": 10,
              "step": 6},   # restarted at step 5: compute_s and tokens count from zero again
             {"kind": "heartbeat", "learner": "a", "incarnation": "2", "time": 6.0, "compute_s": 5.0, "tokens": 50,
              "step": 10},
             {"kind": "heartbeat", "learner": "b", "incarnation": "1", "time": 6.0, "compute_s": 20.0, "tokens": 40,
              "step": 4}]
    assert metrics.time_at_tokens(beats, 0) == 1.0 and metrics.time_at_tokens(beats, 60) == 3.0
    assert metrics.time_at_tokens(beats, 140) == 6.0 and metrics.time_at_tokens(beats, 141) == math.inf
    assert metrics.step_s_between(beats, 0.0, 10.0) == {"a": pytest.approx((4.0 + 4.0) / (4 + 4)), "b": 6.0}
    assert metrics.step_s_between(beats, 2.5, 10.0) == {"a": 1.0}  # b has one beat there, a one of incarnation 1


# --- setups --------------------------------------------------------------------------------------


def test_methods_differ_only_in_what_they_name():
    sync, dec = setups.build("sync", "healthy"), setups.build("decoupled", "healthy")
    assert (sync.syncer.quorum, sync.syncer.merge, sync.syncer.token_weighting, sync.syncer.grace_max_s) == (
        sync.num_learners, "mean", False, 0.0)
    assert dec.syncer.quorum < dec.num_learners and (dec.syncer.merge, dec.syncer.token_weighting) == ("mean", True)
    rda = setups.build("decoupled-rda", "healthy")  # the merge rule and its outer lr alone
    assert rda.model_copy(update={"syncer": dec.syncer, "outer": dec.outer, "run": dec.run}) == dec
    assert (rda.syncer.merge, rda.outer.lr) == ("rda", 0.8)
    assert sync.model == dec.model and sync.fragments.model_copy(
        update={"wait_for_merge": False, "one_delta_per_version": True}) == dec.fragments
    assert sync.fragments.wait_for_merge and not dec.fragments.wait_for_merge
    # the same inner loop, token budget and outer step
    assert sync.inner == dec.inner and sync.outer == dec.outer
    assert setups.build("decoupled", "mixed").regions[1].speed == 0.5
    assert setups.build("decoupled", "wan").transport.wan_bandwidth_mbps == setups.WAN["wan_bandwidth_mbps"]
    assert setups.plan(["dp", "decoupled-p1", "ideal"], ["healthy", "wan"]) == [
        ("dp", "healthy"), ("decoupled-p1", "healthy"), ("ideal", "healthy"), ("dp", "wan")]
    # the quorum variants run where speeds differ too, and differ from decoupled in the round policy alone
    assert setups.plan(["decoupled-k1", "decoupled-fp32"], ["mixed", "failures"]) == [("decoupled-k1", "mixed")]
    for name, (k, grace) in {"decoupled-kM": (4, dec.syncer.grace_max_s), "decoupled-k1": (1, dec.syncer.grace_max_s),
                             "decoupled-k1-nograce": (1, 0.0)}.items():
        v = setups.build(name, "mixed")
        assert v.model_copy(update={"syncer": v.syncer.model_copy(update={"quorum": dec.syncer.quorum,
               "grace_max_s": dec.syncer.grace_max_s}), "run": dec.run}) == setups.build("decoupled", "mixed").model_copy(
               update={"run": dec.run})
        assert (v.syncer.quorum, v.syncer.grace_max_s) == (k, grace)
    nest = setups.build("decoupled-nesterov", "healthy")
    assert (nest.outer.momentum, nest.outer.momentum_per_round, setups.build("sync-nesterov", "healthy").outer.momentum) == (
        0.9, True, 0.9) and setups.build("decoupled-plain", "healthy").syncer.staleness_discount == 0.0
    assert setups.plan(["sync-nesterov", "decoupled-nesterov"], ["mixed"]) == []
    long, quick = setups.build("decoupled", "healthy", "long"), setups.build("decoupled", "healthy", "quick")
    assert long.inner.steps == 5 * quick.inner.steps and long.model == quick.model


def test_the_ternary_methods_differ_from_decoupled_in_their_codecs_and_1000x_in_its_sync_period_too():
    dec = setups.build("decoupled", "healthy", "long")
    want = {"decoupled-ternary": ("ternary", "ternary", "previous", 20),
            "decoupled-ternary-up": ("ternary", "int4", "snapshot", 20),
            "decoupled-1000x": ("ternary", "ternary", "previous", setups.THOUSAND_X_SYNC_EVERY)}
    for name, codecs in want.items():
        cfg = setups.build(name, "healthy", "long")
        assert (cfg.fragments.quantization, cfg.syncer.broadcast, cfg.syncer.updates_from,
                cfg.fragments.sync_every) == codecs
        assert cfg.model_copy(update={"run": dec.run, "fragments": dec.fragments, "syncer": dec.syncer}) == dec
        assert cfg.fragments.model_copy(update={"quantization": dec.fragments.quantization,
                                                "sync_every": dec.fragments.sync_every}) == dec.fragments
    # the acceptance run compares it with int8 at H = 20 in every scenario that heals, not in healthy alone
    assert setups.plan(["decoupled", "decoupled-1000x", "decoupled-ternary"], ["mixed", "failures"]) == [
        ("decoupled", "mixed"), ("decoupled-1000x", "mixed"),
        ("decoupled", "failures"), ("decoupled-1000x", "failures")]


def test_the_1000x_sync_period_clears_1000x_by_the_budget_the_bench_counts():
    """6H / (bytes per parameter up + down per sync period), as setups explains it: the codes of the
    long size's model, a tenth more up for the frames and 1.47 updates down per period, clear 1000x
    with a tenth to spare; a sync period a fifth shorter would not."""
    from diloco import quantize
    from diloco.models.transformer import init_params

    params = init_params(setups.build("decoupled-1000x", "healthy", "long").model.transformer, 0)
    per_param = sum(quantize.encoded_nbytes(a.shape, "ternary") for a in params.values()) / sum(
        a.size for a in params.values())
    assert per_param == pytest.approx(0.244, abs=5e-4)

    def ratio(h: int) -> float:
        return 6 * h / (per_param * (1.1 + 1.47))

    assert ratio(setups.THOUSAND_X_SYNC_EVERY) >= 1100 > 1000 > ratio(int(0.8 * setups.THOUSAND_X_SYNC_EVERY))


def test_scavenge_cases_train_the_same_token_budget_with_0_50_and_100_percent_joining_a_third_in():
    budget = 4 * setups.SCAVENGE_STEPS * 8 * 64    # the starting learners' inner.steps, at the quick size
    assert setups.expand(["healthy", "scavenge"]) == ["healthy", "scavenge-0", "scavenge-50", "scavenge-100"]
    for case, joiners in (("scavenge-0", 0), ("scavenge-50", 2), ("scavenge-100", 4)):
        cfg = setups.build("decoupled", case)
        assert cfg.run.token_budget == budget and cfg.num_learners == 4 and cfg.num_shards == 8
        assert sum(j.count for j in cfg.run.joins) == joiners
        assert all(j.at_tokens_fraction == pytest.approx(1 / 3) for j in cfg.run.joins)
        assert sorted(j.region for j in cfg.run.joins) == (["eu", "us"] if joiners else [])  # split over both
        assert cfg.model_copy(update={"run": setups.build("decoupled", "scavenge-0").run, "regions": cfg.regions}) \
            .model_dump(exclude={"run": {"name"}}) == setups.build("decoupled", "scavenge-0").model_dump(
                exclude={"run": {"name"}})  # the cases differ in their joins alone
    assert setups.build("decoupled", "scavenge-50", overrides=["inner.steps=60"]).run.token_budget == 4 * 60 * 8 * 64
    assert setups.build("decoupled", "healthy").run.token_budget is None
    assert setups.plan(["dp", "sync", "decoupled"], ["scavenge-50"]) == [("dp", "scavenge-50"), ("decoupled", "scavenge-50")]


def test_data_parallel_workers_join_at_the_step_the_budget_share_is_trained():
    start = ("us-0", "us-1", "eu-0", "eu-1")
    assert dp.phases(setups.build("dp", "healthy")) == [(240, start)]
    over = ["inner.steps=240"]                     # budget 491,520 tokens, a third of it after 80 steps of 4
    assert dp.phases(setups.build("dp", "scavenge-0", overrides=over)) == [(240, start)]
    assert dp.phases(setups.build("dp", "scavenge-100", overrides=over)) == [
        (80, start), (80, start + ("us-2", "us-3", "eu-2", "eu-3"))]
    fifty = dp.phases(setups.build("dp", "scavenge-50", overrides=over))
    assert fifty == [(80, start), (107, start + ("us-2", "eu-2"))]   # 106.7 steps of 6 workers: the last counts whole
    assert (80 * 4 + 107 * 6) * 8 * 64 >= 4 * 240 * 8 * 64 > (80 * 4 + 106 * 6) * 8 * 64


# --- harness at a tiny size ----------------------------------------------------------------------

TINY_MODEL = {"d_model": 16, "n_layers": 1, "n_heads": 2, "seq_len": 8}


@pytest.fixture
def tiny_corpus(tmp_path):
    rng = np.random.default_rng(0)
    shards = []
    for i in range(4):
        name = f"train-{i}.bin"
        rng.integers(1, 256, 4000).astype("<u2").tofile(tmp_path / name)
        shards.append({"name": name, "tokens": 4000})
    rng.integers(1, 256, 2000).astype("<u2").tofile(tmp_path / "heldout.bin")
    (tmp_path / "manifest.json").write_text(json.dumps(
        {"format": FORMAT, "shards": shards, "heldout": {"name": "heldout.bin", "tokens": 2000}}))
    return Corpus.open(tmp_path)


def test_dp_step_averages_the_workers_gradients(tiny_corpus):
    cfg = setups.build("dp", "healthy", overrides=[f"model.options.{k}={v}" for k, v in TINY_MODEL.items()])
    opts = cfg.model.transformer
    params = {k: jnp.asarray(v) for k, v in dp.init_params(opts).items()}
    batches = jnp.asarray(np.random.default_rng(1).integers(0, 256, (4, 2, 9)), jnp.int32)
    grad = jax.jit(jax.grad(loss_fn), static_argnums=2)  # one compilation per batch shape, not op by op
    per_worker = [grad(params, b, opts) for b in batches]
    allreduced = jax.tree_util.tree_map(lambda *g: sum(g) / 4, *per_worker)
    whole = grad(params, batches.reshape(8, 9), opts)  # equal batches: the same gradient
    for k in params:
        np.testing.assert_allclose(allreduced[k], whole[k], rtol=1e-4, atol=1e-6)


def test_dp_baseline_runs_a_few_steps_and_its_scenarios(tiny_corpus):
    cfg = setups.build("dp", "wan", overrides=[f"model.options.{k}={v}" for k, v in TINY_MODEL.items()]
                       + ["inner.steps=4", "inner.warmup_steps=1"])
    held = np.random.default_rng(2).integers(0, 256, (2, 2, 9)).astype(np.int32)
    out = dp.train_dp(cfg, tiny_corpus, held, evals=2)
    assert out["curve"]["step"] == [0, 2, 4] and all(np.isfinite(out["curve"]["loss"]))
    r = runs.dp_in_scenario(cfg, "wan", out, {"phase_step_s": [0.2]})
    assert r["step_s"] == [0.2] and r["comm_s"][0] > 0.05
    assert r["time_s"] == pytest.approx(4 * (0.2 + r["comm_s"][0]))
    assert r["bytes_sent"] == runs.dp_allreduce_bytes(runs.num_params(cfg), 4, 16)


def test_dp_baseline_grows_its_batch_when_workers_join(tiny_corpus):
    """A worker joins at half the budget: the steps before it are the same training as without it,
    the steps after average 3 workers' gradients, and the clock charges each phase its own step time."""
    base = [f"model.options.{k}={v}" for k, v in TINY_MODEL.items()] + [
        "inner.steps=4", "inner.warmup_steps=1",
        "regions=[{name: us, learners: 1, max_learners: 2}, {name: eu, learners: 1, max_learners: 2}]"]
    held = np.random.default_rng(2).integers(0, 256, (2, 2, 9)).astype(np.int32)
    alone = dp.train_dp(setups.build("dp", "healthy", overrides=base), tiny_corpus, held, evals=2)
    cfg = setups.build("dp", "healthy", overrides=base + [
        "run.token_budget=512", "run.joins=[{at_tokens_fraction: 0.5, region: us, count: 1}]"])
    out = dp.train_dp(cfg, tiny_corpus, held, evals=2)
    assert out["phases"] == [(2, ("us-0", "eu-0")), (2, ("us-0", "eu-0", "us-1"))]
    assert out["curve"]["tokens"] == [0, 2 * 2 * 64, 2 * 2 * 64 + 2 * 3 * 64] and out["tokens"] == 640
    assert out["curve"]["loss"][1] == pytest.approx(alone["curve"]["loss"][1], rel=1e-6)
    assert abs(out["curve"]["loss"][2] - alone["curve"]["loss"][2]) > 1e-5  # a third worker's gradients
    r = runs.dp_in_scenario(cfg, "healthy", out, {"phase_step_s": [0.1, 0.3]})
    assert r["time_s"] == pytest.approx(2 * 0.1 + 2 * 0.3) and r["curve"]["time_s"] == pytest.approx([0.0, 0.2, 0.8])
    params = runs.num_params(cfg)
    assert r["bytes_sent"] == runs.dp_allreduce_bytes(params, 2, 4) + runs.dp_allreduce_bytes(params, 3, 6)


def test_ideal_outer_round_with_the_mean_rule_and_lr_1_is_the_learners_average():
    cfg = setups.build("ideal", "healthy", overrides=["syncer.merge=mean", "outer.lr=1.0"])
    rng = np.random.default_rng(3)
    glob = {"w": rng.normal(size=(3, 2)).astype(np.float32)}
    local = {"w": rng.normal(size=(cfg.num_learners, 3, 2)).astype(np.float32)}
    opt = ideal.merge.outer_optimizer(1.0, 0.0, False)
    plan = Plan((Tensor("w", (3, 2), "float32", 0, "rda"),), 1)
    fresh = [({"w": glob["w"] - local["w"][i]}, 5, 0) for i in range(cfg.num_learners)]
    new, _ = ideal.outer_round(cfg, plan, glob, ["w"], fresh, opt, opt.init(glob))
    np.testing.assert_allclose(new["w"], local["w"].mean(axis=0), rtol=1e-5, atol=1e-6)


def test_ideal_round_weighs_a_late_delta_by_the_staleness_discount_and_scales_by_its_share():
    """Two of four deltas in a round, one a version late: with discount 1 it weighs half the fresh
    one, and the round moves 2/4 of the way (syncer.scale_partial_rounds)."""
    cfg = setups.build("ideal", "healthy", overrides=["syncer.merge=mean", "outer.lr=1.0",
                                                      "syncer.staleness_discount=1.0"])
    glob = {"w": np.zeros((2,), np.float32)}
    plan = Plan((Tensor("w", (2,), "float32", 0, "rda"),), 1)
    opt = ideal.merge.outer_optimizer(1.0, 0.0, False)
    fresh, late = {"w": np.array([3.0, 0.0], np.float32)}, {"w": np.array([0.0, 3.0], np.float32)}
    new, _ = ideal.outer_round(cfg, plan, glob, ["w"], [(fresh, 5, 0), (late, 5, 1)], opt, opt.init(glob))
    np.testing.assert_allclose(new["w"], -0.5 * np.array([2.0, 1.0]), rtol=1e-6)  # weights 2/3, 1/3


@pytest.mark.parametrize("share", [0.0, 0.5, 1.0])
def test_late_mask_never_leaves_a_round_without_its_quorum(share):
    rng = np.random.default_rng(0)
    masks = np.array([ideal.late_mask(rng, 4, 2, share) for _ in range(2000)])
    assert masks.sum(axis=1).max() <= 2 and (share > 0) == bool(masks.any())
    if share == 0.5:  # below the cap each delta is late with that probability
        assert 0.3 < masks.mean() < 0.45  # 0.5, less what the cap at 2 of 4 takes back


def test_ideal_diloco_with_one_learner_is_plain_training(tiny_corpus):
    """With M = 1, a plain mean and an outer lr of 1 every sync hands the learner's own parameters
    back: the global model follows single-worker data-parallel step for step when every fragment
    syncs every step, and ends equal to it when fragments sync apart (the last step hands all in)."""
    over = [f"model.options.{k}={v}" for k, v in TINY_MODEL.items()] + [
        "inner.steps=6", "inner.warmup_steps=1", "fragments.count=2", "fragments.sync_every=1",
        "syncer.merge=mean", "outer.lr=1.0", "outer.momentum=0.0", "syncer.quorum=1"]
    cfg = setups.build("ideal", "healthy", overrides=over)
    cfg = cfg.model_copy(update={"regions": [cfg.regions[0].model_copy(update={"learners": 1})]})
    held = np.random.default_rng(2).integers(0, 256, (2, 2, 9)).astype(np.int32)
    want = dp.train_dp(cfg, tiny_corpus, held, evals=3)["curve"]
    rounds = []
    got = ideal.train_ideal(cfg, tiny_corpus, held, evals=3, rounds=rounds)["curve"]
    assert got["step"] == want["step"] == [0, 2, 4, 6]
    # what a codec would be fed: each fragment's one delta a step, and the global stepped by all of it
    assert [(p, list(d)) for p, d, _ in rounds] == [(p, [0]) for _ in range(6) for p in (0, 1)]
    for _, deltas, step in rounds:
        for n, x in step.items():
            np.testing.assert_allclose(x, -deltas[0][n], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
    apart = cfg.model_copy(update={"fragments": cfg.fragments.model_copy(update={"sync_every": 4})})
    ends = ideal.train_ideal(apart, tiny_corpus, held, evals=3)["curve"]["loss"]
    assert ends[-1] == pytest.approx(want["loss"][-1], rel=1e-5) and ends[1] != pytest.approx(want["loss"][1], rel=1e-5)
    # and a real outer step (lr 0.5 halves every sync's progress) is not plain training; which of the
    # two ends lower after 6 steps on random tokens is noise (it flipped with the order batches are read in)
    slow = ideal.train_ideal(cfg.model_copy(update={"outer": cfg.outer.model_copy(update={"lr": 0.5})}),
                             tiny_corpus, held, evals=3)["curve"]
    assert all(s != pytest.approx(g, rel=1e-5) for s, g in zip(slow["loss"][1:], got["loss"][1:]))


def test_codec_rules_measure_what_error_feedback_carries():
    from bench import codec_rules
    from diloco import quantize

    stream = [{"w": np.full((2, 5), v, np.float32)} for v in (1.0, 2.0, 3.0)]
    assert codec_rules.feedback(stream, lambda x: x) == {"alone": 0.0, "held": 0.0, "held_back": 0.0}
    nothing = codec_rules.feedback(stream, np.zeros_like)   # a code that sends nothing holds everything back
    assert (nothing["alone"], nothing["held_back"]) == (1.0, 1.0)
    assert nothing["held"] == pytest.approx((1 + 3 + 6) / 3 / 2)   # buffers 1, 3, 6 against messages of 2 on average
    x = np.random.default_rng(0).normal(size=(4, 23)).astype(np.float32)
    np.testing.assert_array_equal(codec_rules.ternary_code(quantize.TERNARY_THRESHOLD)(x),
                                  quantize.roundtrip(x, "ternary"))
    up, down = codec_rules.streams([(0, {0: "a0", 1: "b0"}, "s0"), (1, {0: "a1"}, "t0"), (0, {0: "a2"}, "s1")])
    assert (up, down) == ([["a0", "a2"], ["b0"], ["a1"]], [["s0", "s1"], ["t0"]])


def test_drain_intake_is_compared_with_the_client_per_core_on_both_sides():
    from bench import load

    rows = [{"params_per_fragment": 10_000_000, "shards": 1, "taken_in_mb_per_s": 140.0, "syncer_cores": 0.7}]
    line, = load.intake_against_client(rows, {"client": "librdkafka", "consume_mb_per_core_s": 350.0})
    assert "200 MB/s per core it used, 57% of librdkafka alone's 350 MB/s per core" in line


def test_merge_micro_benchmark_at_a_tiny_size():
    out = merge_bench.run(TransformerOptions(vocab_size=16, d_model=8, n_layers=1, n_heads=2, seq_len=8), k=2, repeats=1)
    assert out["contributions"] == 2 and out["payload_mb"] > 0
    assert out["merge_mb_per_s"] > 0 and out["copy_mb_per_s"] > 0
    b = out["store_bytes"]          # between snapshots a version stores its update and its meta.json
    assert b["update"] < b["between_snapshots"] < b["update"] + 4096 < b["snapshot"]


def _fake(method, scenario, loss, bytes_sent, merge_stats=None, bytes_fetched=0):
    return {"method": method, "scenario": scenario, "tokens": 1000, "loss_end": loss, "bytes_sent": bytes_sent,
            "bytes_fetched": bytes_fetched,
            "bytes_dp": 1e9, "goodput": 0.9, "idle": 0.05, "merge": merge_stats,
            "curve": {"tokens": [0, 500, 1000], "time_s": [0.0, 5.0, 10.0], "loss": [5.0, 3.0, loss]}}


def test_report_writes_a_table_and_plots(tmp_path):
    ms = metrics.merge_stats([{"kind": "contribution_accepted", "id": "a", "bytes": 10, "time": 0.0},
                              {"kind": "merge", "ids": ["a"], "seconds": 0.01, "time": 0.5}])
    results = [_fake("dp", "healthy", 2.0, 1e9), _fake("decoupled", "healthy", 2.1, 1e6, ms, bytes_fetched=3e6),
               {**_fake("ideal", "healthy", 2.05, None), "goodput": None, "idle": None,
                "curve": {"tokens": [0, 1000], "time_s": [math.nan, math.nan], "loss": [5.0, 2.05]}}]
    md = report.write(results, tmp_path, "header\n")
    text = md.read_text()
    assert text.startswith("header\n") and "| healthy | decoupled | 1,000 | 2.1000 | +5.00% |" in text
    assert "| 1,000.00 MB | 1x |" in text and "healthy 2.1000" in text
    assert "| 4.00 MB (1.00 + 3.00) | 250x (1,000x) |" in text    # down counts as much as up
    assert "| healthy | ideal | 1,000 | 2.0500 | +2.50% | – | – | – | – | – |" in text  # no clock, nothing sent
    for name in ("loss_vs_tokens.png", "loss_vs_time.png", "bytes.png"):
        assert (tmp_path / name).stat().st_size > 0
    alone = report.write(results[2:], tmp_path / "ideal-only")  # a run of ideal alone has no bytes to plot
    assert "| healthy | ideal |" in alone.read_text() and not (tmp_path / "ideal-only" / "bytes.png").exists()


def test_a_group_of_cases_shares_one_target_and_is_compared_with_its_first_case(tmp_path):
    def case(method, scenario, loss, times):
        return {**_fake(method, scenario, loss, 1e6), "time_s": times[-1],
                "curve": {"tokens": [0, 500, 1000], "time_s": times, "loss": [5.0, 4.0, loss]}}
    results = [case("dp", "scavenge-0", 2.5, [0.0, 5.0, 10.0]), case("decoupled", "scavenge-0", 3.0, [0.0, 10.0, 20.0]),
               case("decoupled", "scavenge-50", 2.8, [0.0, 5.0, 10.0])]
    text = report.write(results, tmp_path, groups={"scavenge": ["scavenge-0", "scavenge-50"], "other": ["x"]}).read_text()
    assert "**scavenge** (target loss 3.0000" in text and "**other**" not in text
    assert "| scavenge-0 | decoupled | 1,000 | 3.0000 | 20.0 s | 1.00x | 20.0 s | 1.00x |" in text
    assert "| scavenge-50 | decoupled | 1,000 | 2.8000 | 9.2 s | 0.46x | 10.0 s | 0.50x |" in text  # 5 + 5 / 1.2 s
    assert "| scavenge-0 | dp | 1,000 | 2.5000 | 8.3 s | 1.00x |" in text


def test_sharded_bench_compares_the_two_layouts_in_one_run():
    out = sharded_bench.run(devices=2, d_model=32, layers=1, seq_len=8, fragments=2, steps=1)
    r, s = out["rows"]["replicated"], out["rows"]["fsdp"]
    assert (r["fsdp"], s["fsdp"]) == (1, 2) and r["params"] == s["params"]
    assert out["ratios"]["param_mb_per_device"] < 0.6      # each of the 2 devices holds about half
    assert s["sync_host_peak_mb"] > 0 and 0 < out["ratios"]["sync_peak_over_fragment"] < 8  # fixed costs at this size


@pytest.mark.integration
def test_the_load_generator_drives_a_real_syncer_and_measures_it(tiny_config):
    from bench import load

    cfg = tiny_config()
    row = load.run_one(cfg, params=256 * 1024, learners=4, shards=1, seconds=4.0, period_s=1.0, fragments=3)
    assert row["params_per_fragment"] == 256 * 1024 and row["published"] >= 4 * 3 * 3
    assert row["applied"] == row["accepted"] == row["published"] and row["rejected"] == 0   # drained, flushed
    assert row["merges_per_s"] > 0 and row["merged_mb_per_s"] > 0 and row["sent_mb_per_s"] > 0
    assert 0 < row["latency_p50_s"] <= row["latency_p99_s"] < 10
    # between snapshots a version stores its update and a small meta.json
    assert row["versions"] > 8 and row["store_bytes_per_version"] > row["store_bytes_between_snapshots"]
    assert row["update_bytes_per_version"] < row["store_bytes_between_snapshots"] < 1.5 * row["update_bytes_per_version"]
    assert row["syncer_peak_rss_mb"] > 0
    assert row["cores"]["syncer"] > 0 and row["cores"]["generator"] > 0 and 0 < row["machine_busy"] <= 1
    assert 0 < row["merging_cores"] < 1
    _assert_cleaned_up(cfg, row["run"])


def _assert_cleaned_up(cfg, run_id: str) -> None:
    """A row gives back what it took: its topics on the broker, its store and logs on disk."""
    import glob

    from kafka import KafkaAdminClient
    admin = KafkaAdminClient(bootstrap_servers=cfg.transport.bootstrap_servers)
    try:
        assert not [t for t in admin.list_topics() if run_id in t]
    finally:
        admin.close()
    assert not [d for d in glob.glob(f"{tempfile.gettempdir()}/diloco-load-*/config.yaml")
                if run_id in Path(d).read_text(errors="ignore")]


@pytest.mark.integration
def test_the_drain_mode_times_the_syncer_taking_in_a_backlog(tiny_config):
    from bench import load

    cfg = tiny_config()
    row = load.drain_one(cfg, params=256 * 1024, learners=4, shards=1, seconds=2.0, period_s=1.0, fragments=3)
    assert row["published"] == 4 * 3 * 2 and row["decided"] == row["published"]
    assert row["applied"] == row["accepted"] == row["published"] and row["rejected"] == 0
    assert row["seconds"] > 0 and row["taken_in_mb_per_s"] > 0 and row["merges_per_s"] > 0
    assert row["syncer_cores"] > 0
    _assert_cleaned_up(cfg, row["run"])


def test_several_seeds_give_a_mean_and_spread_per_method_and_the_gap_to_sync(tmp_path):
    results = [{**_fake(m, "healthy", loss, 1e6), "seed": s}
               for s, (dp, sync, dec) in enumerate([(2.0, 2.2, 2.3), (2.1, 2.4, 2.3)])
               for m, loss in (("dp", dp), ("sync", sync), ("decoupled", dec))]
    text = report.write(results, tmp_path).read_text()
    assert "| healthy | decoupled | 1,000 | 2.3000 |" in text  # the main table: seed 0 alone
    assert "**Over seeds 0, 1**" in text
    # mean 2.3 vs sync's 2.3: +0.00%; vs DP's 2.05: +12.20%; sd of (2.2, 2.4) = 0.1414
    assert "| healthy | decoupled | 2 | 2.3000, 2.3000 | 2.3000 ± 0.0000 | +0.00% | +12.20% |" in text
    assert "| healthy | sync | 2 | 2.2000, 2.4000 | 2.3000 ± 0.1414 | +0.00% | +12.20% |" in text
    # each seed's target is its worst final loss (2.3, then 2.4): decoupled reaches it at 10 s, then at
    # 5 + 5 * (3 - 2.4) / (3 - 2.3) = 9.29 s
    assert "| +0.00% | +12.20% | 9.6 ± 0.5 s | 90.0% | – | – |" in text   # no merge figures in these rows
    ms = metrics.merge_stats([{"kind": "contribution_accepted", "id": "a", "bytes": 10, "time": 0.0},
                              {"kind": "merge", "ids": ["a"], "seconds": 0.01, "time": 0.5}])
    merged = [{**r, "merge": {**ms, "round_size": 2.0 + r["seed"], "late_share": 0.25}} for r in results]
    assert "| 90.0% | 2.50 ± 0.71 | 25% ± 0% |" in report.write(merged, tmp_path / "m").read_text()


def _coded_run(method: str, seed: int, loss: float, up: float, down: float, codecs=("int8", "int8")) -> dict:
    return {"method": method, "scenario": "healthy", "seed": seed, "loss_end": loss, "bytes_sent": up,
            "bytes_fetched": down, "bytes_dp": 1000.0, "codecs": {"up": codecs[0], "down": codecs[1]}}


def test_the_bytes_quality_table_pairs_gaps_by_seed_and_ratios_count_both_ways(tmp_path):
    results = [_coded_run("decoupled", 0, 2.0, 5.0, 5.0), _coded_run("decoupled", 1, 3.0, 5.0, 5.0),
               _coded_run("decoupled-topk", 0, 2.02, 0.5, 0.5, ("topk", "topk")),
               _coded_run("decoupled-topk", 1, 3.06, 0.5, 1.5, ("topk", "topk")),
               {"method": "dp", "scenario": "healthy", "seed": 0, "loss_end": 1.9, "bytes_sent": 1000.0,
                "bytes_fetched": 0, "bytes_dp": 1000.0}]
    table = {row["method"]: row for row in report.bytes_quality(results)}
    assert set(table) == {"decoupled", "decoupled-topk"}                      # data-parallel is the unit, not a row
    topk = table["decoupled-topk"]
    assert topk["ratio"] == pytest.approx((1000 / 1 + 1000 / 2) / 2) and topk["ratio_up"] == pytest.approx(2000)
    assert topk["gap"] == pytest.approx((1.0 + 2.0) / 2) and topk["gap_se"] == pytest.approx(0.5)  # paired: +1%, +2%
    assert table["decoupled"]["gap"] is None and (topk["up"], topk["down"]) == ("topk", "topk")
    md = report.bytes_quality_markdown(report.bytes_quality(results))
    assert "| decoupled-topk | topk | topk | 2 |" in md and "+1.50% ± 0.50%" in md
    assert report.plot_bytes_quality(list(table.values()), tmp_path) == ["bytes_vs_loss.png"]
    assert (tmp_path / "bytes_vs_loss.png").stat().st_size > 0


@pytest.mark.integration
def test_the_learner_bench_puts_a_session_beside_the_plain_loop_and_counts_what_the_library_holds(tiny_config):
    """`python -m bench learner` at a tiny size: both loops timed, the library's time split by kind of
    step (a sync every step in the paper's layout, and the syncer's versions applied), its device
    bytes within a fragment's transients (the anchors live on the host), its host bytes counted."""
    from bench import learner_bench

    cfg = tiny_config()
    rows = learner_bench.run(sizes=["tiny"], layouts=["paper"], steps=24, blocks=1, batch_size=2, seq_len=16, pin=False,
                             overrides=[f"transport.bootstrap_servers={cfg.transport.bootstrap_servers}",
                                        f"state.redis_url={cfg.state.redis_url}"],
                             sizes_table={"tiny": (64, 4)}, progress=lambda line: None)
    (row,) = rows
    assert row["layout"] == "paper" and row["fragments"] == row["H"] == 24 and row["anchor"] == "host"
    assert row["step_ms_plain"] > 0 and row["step_ms_session"] > 0
    assert row["library_steps"]["sync"] > 0 and row["library_steps"]["apply"] > 0     # the syncer merged and sent back
    assert row["library_ms_per_step"]["sync"] > 0 and row["library_ms_per_step"]["apply"] > 0
    assert row["device_bytes_library"] <= row["largest_fragment_bytes"]   # codes in flight, no copy of the model
    assert row["param_bytes"] <= row["host_bytes_library"]               # the anchors: the fetched snapshot and codes, on the host
    assert learner_bench.table(rows).count("| paper |") == 1
