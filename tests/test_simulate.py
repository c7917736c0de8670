"""The goodput simulator against what can be worked out by hand."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
from typer.testing import CliRunner

from diloco.sim.checkpointing import best_checkpoint_interval, dp_goodput
from diloco.sim.goodput import (
    SCHEMES,
    YEAR_S,
    Arrival,
    Cluster,
    Diloco,
    learner_slices,
    simulate,
    simulate_diloco,
)
from diloco.syncer import rounds
from diloco.syncer.policy import Decision, QuorumPolicy


def steady(**kw) -> Cluster:
    """No failures, no jitter: whatever is lost comes from the configured overheads alone."""
    return Cluster(**{"chips": 8192, "mtbi_years": math.inf, "step_cv": 0.0, "hours": 1.0, **kw})


@pytest.mark.parametrize("scheme", SCHEMES)
def test_no_failures_is_full_goodput(scheme):
    assert simulate(scheme, steady()).goodput == pytest.approx(1.0, abs=1e-12)


def test_no_failures_loses_only_the_configured_overheads():
    # a merge that takes longer than the overlap hides makes every learner wait the difference:
    # 50 steps of 2 s, then 10 s of waiting; 1.1 h is exactly 36 such rounds
    setup = Diloco(learners=4, sync_every=50, overlap_steps=0, sync_s=10.0)
    assert simulate("diloco", steady(hours=1.1), setup).goodput == pytest.approx(100 / 110, abs=1e-12)
    # a synchronous step waits for its slowest slice: the mean of the Gumbel maximum, exactly for dp
    c = steady(step_cv=0.05)
    pace = c.step_s / c.mean_step_s(c.slices())
    assert pace < 0.97
    assert simulate("dp", c).goodput == pytest.approx(pace, abs=1e-12)
    assert simulate("elastic-dp", c).goodput == pytest.approx(pace, abs=2e-3)


def test_dp_matches_the_closed_form():
    for checkpoint_s in (1.0, 0.0):
        c = Cluster(chips=1_200_000, step_cv=0.0, checkpoint_s=checkpoint_s, hours=24 * 10)
        rate, restart = c.chips / (c.mtbi_years * YEAR_S), c.recovery_s + c.reconfig_s
        expected = dp_goodput(rate, restart, checkpoint_s, best_checkpoint_interval(rate, restart, checkpoint_s))
        r = simulate("dp", c)
        assert r.failures == pytest.approx(rate * c.horizon_s / (1 + rate * restart), rel=0.03)
        assert r.goodput == pytest.approx(expected, abs=0.01)  # ~13k failures: a few standard errors
    assert dp_goodput(rate, restart, 0.0, 0.0) == pytest.approx(1 / (1 + rate * restart))


def test_checkpoint_interval_is_young_daly_when_failures_are_rare():
    rate, checkpoint_s = 1e-6, 60.0
    assert best_checkpoint_interval(rate, 600.0, checkpoint_s) == pytest.approx(
        math.sqrt(2 * checkpoint_s / rate), rel=0.03)


def test_diloco_with_full_quorum_and_no_grace_is_synchronous():
    # two learners of 8 slices against one elastic job of 16; failures rare enough not to overlap much
    c = Cluster(chips=16384, slice_chips=1024, mtbi_years=0.1, step_cv=0.0, hours=24.0)
    sync = Diloco(learners=2, quorum=2, grace_max_s=0.0, overlap_steps=0, sync_s=0.0)
    full = simulate("diloco", c, sync)
    elastic = simulate("elastic-dp", c)
    assert full.failures > 300 and full.late == 0  # every round waited for every learner
    assert full.goodput == pytest.approx(elastic.goodput, abs=0.02)
    # the same learners with K = 1 lose only their own pauses
    assert simulate("diloco", c, Diloco(learners=2, quorum=1, grace_max_s=0.0, overlap_steps=0,
                                         sync_s=0.0)).goodput > full.goodput + 0.02


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_seed_reproduces_its_run(scheme):
    c = Cluster(chips=200_000, hours=2.0)
    assert simulate(scheme, c, seed=3) == simulate(scheme, c, seed=3)
    assert simulate(scheme, c, seed=3) != simulate(scheme, c, seed=4)


def test_cli_json_rows(tmp_path):
    from diloco.cli import app

    plot = tmp_path / "goodput.png"
    out = CliRunner().invoke(app, ["simulate", "goodput", "--chips", "4096,65536", "--hours", "1", "--json",
                                   "--workers", "2", "--plot", str(plot)])
    assert out.exit_code == 0, out.output
    rows = json.loads(out.stdout)
    assert [(r["scheme"], r["chips"]) for r in rows] == [(s, n) for n in (4096, 65536) for s in SCHEMES]
    for r in rows:
        assert set(r) == {"scheme", "chips", "learners", "quorum", "goodput"}
        assert 0.0 < r["goodput"] <= 1.0
    assert [(r["learners"], r["quorum"]) for r in rows if r["scheme"] == "diloco"] == [(8, 4), (8, 4)]
    assert plot.stat().st_size > 0


def test_cli_rejects_an_unknown_scheme():
    from diloco.cli import app

    out = CliRunner().invoke(app, ["simulate", "goodput", "--schemes", "dp,ring", "--hours", "1"])
    assert out.exit_code == 2 and "ring" in out.output


def test_spares_trade_the_pauses_for_the_spare_time_and_the_unsent_steps():
    c = Cluster(chips=65536, mtbi_years=0.05, step_cv=0.0, hours=2.0, reconfig_s=60.0)  # a failure every ~24 s
    assert simulate("diloco", steady(), Diloco(learners=4, spares=True)).goodput == pytest.approx(1.0, abs=1e-12)
    often = Diloco(learners=4, sync_every=5, overlap_steps=0)        # little unsent work to lose
    spares = [simulate("diloco", c, Diloco(**{**vars(often), "spares": True, "spare_s": s})).goodput for s in (2.0, 30.0)]
    elastic = simulate("diloco", c, often).goodput                     # two 60 s pauses per failure
    assert elastic < spares[1] < spares[0] < 1.0
    rarely = Diloco(learners=4, sync_every=200, overlap_steps=8)       # a spare loses ~100 unsent steps
    assert simulate("diloco", c, Diloco(**{**vars(rarely), "spares": True, "spare_s": 2.0})).goodput < \
        simulate("diloco", c, rarely).goodput
    with pytest.raises(ValueError, match="spare_s"):
        Diloco(spare_s=-1.0)


# --- the capacity plan (diloco simulate capacity) --------------------------------------------------

from diloco.sim import capacity as cap  # noqa: E402


def test_the_10b_plan_matches_the_arithmetic_of_its_layout():
    """10B parameters, 24 fragments synced every 24 steps of 2 s by 8 learners, int8 up: the syncer
    takes in 8 x 10B x ~1 byte every 48 s, about 1.7 GB/s (the figure issue 32 starts from)."""
    p = cap.plan(cap.Layout(10e9, 24, 24, 8))
    int8 = (4 * 1024 + 1024 * 1024) / (1024 * 1024)                  # a per-row fp32 scale on 1024 codes
    assert p["contribution_bytes"] == pytest.approx(10e9 / 24 * int8)
    assert p["contributions_per_s"] == pytest.approx(8 * 24 / 48)
    assert p["intake_bytes_per_s"] == pytest.approx(8 * 10e9 * int8 / 48) and 1.6e9 < p["intake_bytes_per_s"] < 1.8e9
    assert p["versions_per_s_per_fragment"] == pytest.approx(8 / (4 * 48))   # K = M // 2 = 4
    per_fragment = p["intake_bytes_per_s"] / 24 / (cap.INTAKE_MB_S * 1e6) + 8 / (4 * 48) * 10e9 / 24 * 8e-9
    assert p["core_load_per_fragment"] == pytest.approx(per_fragment) and p["syncer_cores"] == pytest.approx(24 * per_fragment)
    fit = int(0.7 // per_fragment)                                    # fragments a shard keeps 70% busy
    assert p["fragment_fits_a_shard"] and p["shards"] == -(-24 // fit) and p["fragments_per_shard"] == -(-24 // p["shards"])
    on_kafka_python = cap.plan(cap.Layout(10e9, 24, 24, 8, intake_mb_s=cap.INTAKE_MB_S_BY_CLIENT["kafka-python"]))
    assert on_kafka_python["syncer_cores"] > 1.5 * p["syncer_cores"]
    assert p["kafka"]["partitions_per_topic"] == 24 and p["kafka"]["bytes_per_s_per_topic"] == pytest.approx(
        p["intake_bytes_per_s"] / 2)
    int4 = 0.5 + 4 / 1024
    # a learner sends every fragment once per period and fetches each new version: K = 4 of 8 closes
    # up to two rounds per period, so up to two int4 updates per fragment come down
    assert p["learner_bytes_per_s"]["up"] == pytest.approx(10e9 * int8 / 48)
    assert p["learner_bytes_per_s"]["down"] == pytest.approx(2 * 10e9 * int4 / 48)
    assert p["learner_fetches_per_period"] == {"fewest": 1.0, "most": 2.0}
    # data-parallel as the run summary counts it: each of 8 workers sends 2 x 7/8 of the fp32 gradient a step
    dp = 2 * 7 / 8 * 4
    assert p["bytes_ratio_vs_dp"] == pytest.approx(dp * 24 / (int8 + 2 * int4))
    assert p["bytes_ratio_vs_dp_one_fetch"] == pytest.approx(dp * 24 / (int8 + int4))


def test_the_plans_bytes_ratio_brackets_what_the_demo_measured():
    """The demo's layout (configs/local.yaml: 443,008 parameters, P = 4, M = 4, K = 2, int4 + zstd both
    ways). Its runs measured 319x and 326x at H = 50 and 223x-266x at H = 40 (README, docs/bench.md):
    each inside the plan's range, between fetching every one of M / K rounds and one version a period."""
    for H, measured in ((50, (319, 326)), (40, (223, 224, 234, 250, 261, 266))):
        p = cap.plan(cap.Layout(443_008, 4, H, 4, quorum=2, quantization="int4", broadcast="int4", packing_ratio=0.85))
        assert all(p["bytes_ratio_vs_dp"] < m < p["bytes_ratio_vs_dp_one_fetch"] for m in measured), (H, p["bytes_ratio_vs_dp"])
    from diloco.summary import dp_allreduce_bytes
    assert cap.dp_allreduce_bytes is dp_allreduce_bytes   # one count of data-parallel's bytes for both


def test_shards_pack_fragments_up_to_the_target_load_and_say_when_a_fragment_is_too_big():
    small = cap.plan(cap.Layout(1e9, 24, 24, 8))          # 0.06 of a core per fragment: 11 fit in 0.7
    assert small["fragments_per_shard"] * small["core_load_per_fragment"] <= 0.7
    assert small["shards"] == math.ceil(24 / small["fragments_per_shard"]) < 24
    big = cap.plan(cap.Layout(100e9, 24, 24, 8))          # 6 cores' work per fragment: cut finer
    assert not big["fragment_fits_a_shard"] and big["shards"] == 24
    finer = cap.plan(cap.Layout(100e9, big["fragments_needed"], 24, 8))
    assert finer["fragment_fits_a_shard"] and finer["core_load_per_fragment"] <= 0.7 + 1e-9
    more_quorum = cap.plan(cap.Layout(10e9, 24, 24, 8, quorum=8))   # fewer versions: less outer-step work
    assert more_quorum["syncer_cores"] < cap.plan(cap.Layout(10e9, 24, 24, 8))["syncer_cores"]


@pytest.mark.parametrize("bad, match", [({"params": 0}, "params must be positive"), ({"quorum": 9}, "quorum must be"),
                                        ({"quantization": "int9"}, "unknown codec"),
                                        ({"target_load": 1.5}, "target load")])
def test_an_impossible_layout_is_refused(bad, match):
    kw = {"params": 1e9, "fragments": 4, "sync_every": 10, "learners": 8} | bad
    with pytest.raises(ValueError, match=match):
        cap.Layout(**kw)


def test_cli_capacity_prints_the_plan_and_json():
    from diloco.sim.cli import app

    res = CliRunner().invoke(app, ["capacity", "--params", "10e9", "--fragments", "24", "--sync-every", "24",
                                   "--learners", "8"])
    assert res.exit_code == 0, res.output
    out = " ".join(res.output.split())
    assert "1.67 GB/s" in out and "12 x 2 fragments" in out               # librdkafka's intake rate
    old = CliRunner().invoke(app, ["capacity", "--params", "10e9", "--fragments", "24", "--sync-every", "24",
                                   "--learners", "8", "--consumer", "kafka-python"])
    assert "24 x 1 fragments" in " ".join(old.output.split())            # kafka-python's: one fragment per shard
    wrong = CliRunner().invoke(app, ["capacity", "--params", "1e9", "--consumer", "sarama"])
    assert wrong.exit_code == 2 and "librdkafka, kafka-python" in wrong.output
    js = CliRunner().invoke(app, ["capacity", "--params", "1e9", "--json"])
    assert json.loads(js.stdout)["layout"]["quorum"] == 4
    bad = CliRunner().invoke(app, ["capacity", "--params", "1e9", "--quantization", "int9"])
    assert bad.exit_code == 2 and "unknown codec" in bad.output


# --- the syncer as it now is: quorum of fresh deltas, held deltas -----------------------------------

def test_without_the_fresh_quorum_the_numbers_are_those_of_the_syncer_before_it():
    """quorum_of_fresh = False is the syncer before syncer.quorum_of_fresh: these are the figures the
    simulator gave then (seed 0), to the last bit, with held deltas on or off (a learner that waits for
    a newer version never holds)."""
    c = Cluster(chips=200_000, hours=6.0)
    before = {(4, False): (0.9602630579297253, 207, 826), (1, False): (0.7260004748338138, 491, 628),
              (8, False): (0.9276866096866099, 101, 0), (4, True): (0.9077459639126305, 196, 779)}
    for (k, spares), (goodput, rounds, late) in before.items():
        for hold in (True, False):
            setup = Diloco(quorum=k, grace_max_s=0.0 if k == 8 else 3.0, spares=spares, quorum_of_fresh=False,
                           hold_deltas=hold)
            r = simulate("diloco", c, setup)
            assert (r.goodput, r.rounds, r.late) == (goodput, rounds, late)


def test_the_simulated_syncer_judges_its_arrivals_by_the_syncers_own_due():
    """Learner 0's delta is a version late and does not count towards K = 2; learner 1 counts once, at
    its first arrival: quorum at 4.0, 2 s after the first, grace = 0.5 x (8 x 1 s - 2 s) = 3 s."""
    arrivals = [Arrival(0, 1.0, 1.0, 1.0, 2), Arrival(1, 2.0, 1.0, 1.0, 3), Arrival(1, 2.5, 1.0, 1.0, 3),
                Arrival(2, 4.0, 1.0, 1.0, 3)]
    policy, learners = QuorumPolicy(2, 8, 0.5, 3.0), {0, 1, 2, 3}

    def due(now, arrivals=arrivals, fresh=True):
        return rounds.due(policy, 3, arrivals, live=learners, present=learners, now=now, step_time_s=1.0,
                          sync_time_s=0.0, quorum_of_fresh=fresh)
    assert due(4.0) == Decision(False, "grace", 7.0) and due(7.0) == Decision(True, "grace_expired", 7.0)
    assert due(4.0, arrivals[:2]) == Decision(False, "waiting_for_quorum") and due(4.0, []) is None
    assert due(2.0, arrivals[:2], fresh=False) == Decision(False, "grace", 2.0 + 3.0)  # grace_max_s: 3 s


def test_the_simulator_imports_without_the_syncer_extra():
    """`diloco simulate` runs on a base install: the round rule it shares with the syncer must not
    pull numba (the merge kernels) in."""
    probe = "import sys, diloco.sim.goodput; print(sorted(m for m in sys.modules if m.split('.')[0] == 'numba'))"
    assert subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True).stdout == "[]\n"


def test_late_deltas_no_longer_close_rounds_alone():
    """K = 1: without the fresh quorum every arrival closes a round, the version races ahead and
    max_staleness rejects a quarter of the tokens; with it a round needs a delta trained from the
    current version, late ones ride along with it, and every token is merged."""
    c = Cluster(chips=200_000, hours=6.0)
    old = simulate("diloco", c, Diloco(quorum=1, quorum_of_fresh=False))
    new = simulate("diloco", c, Diloco(quorum=1))
    assert old.merged_share < 0.8 and new.merged_share == 1.0
    assert new.rounds < old.rounds / 3 and new.goodput > old.goodput + 0.2


def test_a_learner_that_does_not_wait_holds_a_second_delta_from_the_same_version():
    """Without the wait, fast learners three times as fast as the slow ones under K = M would send a
    second and a third delta from version 0 before the slow ones' first: held, they send one, bigger,
    once the version moves. Nothing is lost either way; the deltas are fewer."""
    from diloco.sim.scenarios import Mixed

    c = steady(chips=8 * 1024, hours=2.0)
    speeds = Mixed(slow_factor=3.0).speeds(8)
    setup = Diloco(quorum=8, grace_max_s=0.0, wait_for_merge=False)
    held = simulate_diloco(c, setup, np.random.default_rng(0), speeds=speeds)
    sent = simulate_diloco(c, Diloco(**{**vars(setup), "hold_deltas": False}), np.random.default_rng(0), speeds=speeds)
    assert held.goodput == sent.goodput == pytest.approx(1.0) and held.merged_share == sent.merged_share == 1.0
    assert held.contributions < 0.7 * sent.contributions


# --- scavenged compute (diloco simulate scavenge) ------------------------------------------------------

from diloco.sim import scenarios as sn  # noqa: E402


def test_no_extra_or_no_share_of_it_is_the_base_run():
    c = Cluster(chips=65536, mtbi_years=0.05)  # a failure every ~24 s: the runs are not trivial
    for s in (sn.Scavenge(extra=0.0, budget_hours=2.0), sn.Scavenge(extra=1.0, share=0.0, budget_hours=2.0)):
        for row in sn.scavenge(c, Diloco(), [s]):
            assert row.ratio == 1.0 and row.base_failures > 100


def test_without_failures_both_schemes_come_within_a_hair_of_the_ideal():
    """No failures, no jitter, free joins: the only costs left are dp's re-forming pause and
    diloco's rounds, so the times are those of a lossless system, share / (1 + x) + 1 - share."""
    c = steady()
    setup = Diloco(sync_every=20, overlap_steps=4)
    for x in (0.25, 1.0, 3.0):
        dp, diloco = sn.scavenge(c, setup, [sn.Scavenge(extra=x, budget_hours=4.0, join_s=0.0)])
        assert diloco.ideal == pytest.approx(0.5 + 0.5 / (1 + x))
        assert diloco.ratio == pytest.approx(diloco.ideal, abs=0.005)
        assert dp.ideal < dp.ratio < dp.ideal + 0.002
    slow_join = sn.scavenge(c, setup, [sn.Scavenge(extra=1.0, budget_hours=4.0, join_s=600.0)], schemes=("diloco",))
    assert slow_join[0].ratio > 0.75 + 0.01  # ten minutes of the extra learners' half are lost


def test_the_paper_scavenging_figures():
    """1.2M chips, MTBI 1 year, 8 learners: diloco's four ratios are the paper's, and data-parallel,
    whose bigger job fails more often than its extra chips can make up for, is above it at every level."""
    c = Cluster()
    papers = sn.PAPER_SCAVENGE["diloco"]
    rows = sn.scavenge(c, Diloco(), [sn.Scavenge(extra=extra) for extra in papers])
    for paper, dp, diloco in zip(papers.values(), rows[::2], rows[1::2]):
        assert diloco.ratio == pytest.approx(paper, abs=0.02) and diloco.paper == paper
        assert dp.ratio > diloco.ratio + 0.05
    assert diloco.ratio == pytest.approx(0.62, abs=0.05)


def test_a_graceful_leave_merges_the_work_an_abrupt_one_loses():
    c = Cluster(chips=65536, mtbi_years=0.05)
    abrupt, graceful = (sn.scavenge(c, Diloco(), [sn.Scavenge(extra=3.0, budget_hours=6.0, graceful_leave=g)],
                                    schemes=("diloco",))[0].ratio for g in (False, True))
    assert graceful < abrupt - 0.005


def test_dp_to_a_work_target_takes_what_the_closed_form_says():
    c = Cluster(step_cv=0.0)
    rate, restart = c.chips / (c.mtbi_years * YEAR_S), c.recovery_s + c.reconfig_s
    expected = dp_goodput(rate, restart, c.checkpoint_s, best_checkpoint_interval(rate, restart, c.checkpoint_s))
    work = c.chips * 240 * 3600.0  # ten days of the cluster: ~10k failures
    seconds, failures, done = sn.dp_time_to_work(work, c.chips, c, c.chips, np.random.default_rng(0))
    assert work <= done < work + c.chips * 10 and failures > 5000
    assert work / (c.chips * seconds) == pytest.approx(expected, abs=0.01)


# --- two chip generations (diloco simulate mixed) -----------------------------------------------------

def test_mixed_hardware_makes_fast_learners_wait_under_a_full_quorum():
    """Half the learners 1.5x slower, no failures: K = M holds the fast half idle a third of each slow
    period; K = 1 loses only the straggling inside each learner."""
    c = Cluster(mtbi_years=math.inf, hours=6.0)
    full, alone, grace = sn.mixed(c, Diloco(), sn.Mixed())
    pace = c.step_s / c.mean_step_s(learner_slices(c, 8)[0])
    assert full.goodput == pytest.approx(pace * (0.5 / 1.5 + 0.5), abs=0.01)
    assert alone.goodput == pytest.approx(pace, abs=0.002) and grace.goodput == pytest.approx(pace, abs=0.002)
    assert full.merged_share == alone.merged_share == grace.merged_share == 1.0 and full.late_share == 0.0
    # without the fresh quorum, K = 1 lets the fast learners race the version past the slow ones' deltas,
    # which are then rejected as stale; the grace window, batching close arrivals, saves most of them
    old = sn.mixed(c, Diloco(quorum_of_fresh=False), sn.Mixed())
    assert old[1].merged_share < 0.75 < old[2].merged_share and old[2].goodput > old[1].goodput + 0.2


def test_cli_scavenge_and_mixed_json():
    from diloco.cli import app

    out = CliRunner().invoke(app, ["simulate", "scavenge", "--chips", "16384", "--extra", "50,300",
                                   "--budget-hours", "2", "--workers", "1", "--json"])
    assert out.exit_code == 0, out.output
    rows = json.loads(out.stdout)
    assert [(r["scheme"], r["extra"], r["paper"]) for r in rows] == [
        ("dp", 0.5, None), ("diloco", 0.5, 0.83), ("dp", 3.0, 0.8), ("diloco", 3.0, 0.62)]
    assert all(0.5 < r["ratio"] < 1.0 and r["extra_chips"] == r["extra"] * 16384 for r in rows)
    table = CliRunner().invoke(app, ["simulate", "scavenge", "--chips", "16384", "--extra", "100",
                                     "--budget-hours", "1", "--workers", "1"])
    assert table.exit_code == 0 and "+100%" in table.output
    out = CliRunner().invoke(app, ["simulate", "mixed", "--chips", "16384", "--hours", "1", "--json"])
    assert out.exit_code == 0, out.output
    assert [(r["quorum"], r["grace_max_s"]) for r in json.loads(out.stdout)] == [(8, 0.0), (1, 0.0), (1, 3.0)]
    bad = CliRunner().invoke(app, ["simulate", "scavenge", "--schemes", "elastic-dp"])
    assert bad.exit_code == 2 and "elastic-dp" in bad.output
