"""Elastic membership: who may join is config, joiners get their own data shard, the operator's
requests to a local run, membership over time, and a live run that grows and shrinks."""

from __future__ import annotations

import io
import json
import threading
from types import SimpleNamespace
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import NoRecords, assert_exact_accounting, run_events
from rich.console import Console

from diloco import membership
from diloco.config import ConfigError, build_config
from diloco.run import train
from diloco.supervisor import RunSupervisor

REGIONS = [{"name": "us", "learners": 1, "max_learners": 2}, {"name": "eu", "learners": 1, "max_learners": 3}]


def test_members_are_the_starting_learners_then_those_that_may_join_each_with_its_own_shard():
    cfg = build_config({"regions": REGIONS})
    assert cfg.learner_ids() == ["us-0", "eu-0"]
    assert cfg.member_ids() == ["us-0", "eu-0", "us-1", "eu-1", "eu-2"]
    assert cfg.num_shards == 5 and [cfg.shard_index(lid) for lid in cfg.member_ids()] == [0, 1, 2, 3, 4]
    assert cfg.region_of("eu-2").name == "eu" and cfg.is_member_id("us-1")
    for stranger in ("us-2", "eu-3", "ap-0", "us-01", "us"):
        assert not cfg.is_member_id(stranger)
        with pytest.raises(ConfigError, match=r"may join"):
            cfg.region_of(stranger)


def test_without_max_learners_nothing_changes_and_nobody_may_join():
    cfg = build_config({"regions": [{"name": "us", "learners": 2}, {"name": "eu", "learners": 2}]})
    assert cfg.member_ids() == cfg.learner_ids() and cfg.num_shards == cfg.num_learners == 4
    with pytest.raises(ConfigError, match="no region takes joins"):
        cfg.shard_index("us-2")


@pytest.mark.parametrize("region, words", [
    ({"name": "us", "learners": 3, "max_learners": 2}, "below learners"),
    ({"name": "us", "learners": 1, "max_learners": 2, "min_learners": 3}, "min_learners"),
])
def test_membership_bounds_that_contradict_each_other_are_refused(region, words):
    with pytest.raises(ConfigError, match=words):
        build_config({"regions": [region]})


def test_membership_over_time_counts_each_change_once():
    events = [
        {"kind": "learner_joined", "learner": "us-0", "time": 1.0},           # a starting learner: no change
        {"kind": "learner_admitted", "learner": "eu-1", "time": 2.0},
        {"kind": "learner_admitted", "learner": "eu-1", "time": 2.0},          # delivered twice
        {"kind": "learner_joined", "learner": "eu-1", "time": 2.1},            # its first beat: no change
        {"kind": "learner_left", "learner": "us-0", "time": 3.0},
        {"kind": "learner_silent", "learner": "eu-0", "time": 3.5},            # silent is still a member
        {"kind": "learner_finished", "learner": "eu-1", "time": 4.0},
        {"kind": "learner_joined", "learner": "us-0", "time": 5.0},            # came back after leaving
    ]
    points = membership.timeline(["us-0", "eu-0"], events, start=0.0)
    assert [(p["time"], p["members"], p["change"]) for p in points] == [
        (0.0, 2, "start"), (2.0, 3, "learner_admitted"), (3.0, 2, "learner_left"), (4.0, 1, "learner_finished"),
        (5.0, 2, "learner_joined")]


BUDGET = {"regions": [{"name": "us", "learners": 2, "max_learners": 4}, {"name": "eu", "learners": 2, "max_learners": 3}],
          "run": {"token_budget": 1000, "joins": [{"at_tokens_fraction": 0.3, "region": "us", "count": 2},
                                                 {"at_tokens_fraction": 0.5, "region": "eu"}]}}


@pytest.mark.parametrize("change, words", [
    ({"run": {"token_budget": None}}, r"run.joins.0: .*run.token_budget, which is not set"),
    ({"run": {"joins": [{"at_tokens_fraction": 0.3, "region": "ap"}]}}, r"run.joins.0: region 'ap' is not one of"),
    ({"run": {"joins": [{"at_tokens_fraction": 1.0, "region": "us"}]}}, r"run.joins.0.at_tokens_fraction"),
    ({"run": {"joins": [{"at_tokens_fraction": 0.3, "region": "eu", "count": 2}]}},
     r"add 2 learners to region eu, which starts with 2 and may have 3"),
])
def test_joins_that_cannot_happen_are_refused_at_load_time(change, words):
    tree = {"regions": BUDGET["regions"], "run": {**BUDGET["run"], **change["run"]}}
    with pytest.raises(ConfigError, match=words):
        build_config(tree)


class _Jobs:
    """Records what the runner asks of its process backend (no processes start)."""

    def __init__(self):
        self.jobs, self.signals = {}, []

    def start(self, name, argv, processes=1):
        self.jobs[name] = argv

    def poll(self, name):
        return None

    def signal(self, name, sig):
        self.signals.append((name, sig))


def _beat(run: RunSupervisor, lid: str, tokens: int) -> None:
    run.prog.apply({"kind": "heartbeat", "eid": f"{lid}-{tokens}", "learner": lid, "incarnation": "1",
                    "tokens": tokens, "step": tokens // 10})


def _budget_run(tmp_path: Path, jobs, redis_url: str | None = None) -> RunSupervisor:
    """A runner of the BUDGET run on `jobs`; with `redis_url`, on that Redis under a run id of its own."""
    tree = {**BUDGET, "run": {**BUDGET["run"], "id": "budget"}, "store": {"url": f"file://{tmp_path}/store"}}
    if redis_url:
        tree |= {"run": {**tree["run"], "id": f"budget-{time.time_ns()}"}, "state": {"redis_url": redis_url}}
    cfg = build_config(tree)
    return RunSupervisor(cfg, tmp_path / "config.yaml", SimpleNamespace(dir=tmp_path), jobs, None, Console(quiet=True), [],
                         state=None if redis_url else NoRecords())


def _merge(run: RunSupervisor, tokens: int) -> None:
    """One merge of `tokens` tokens on every fragment, stored as the syncer stores a version, then
    its merge event as the runner reads it from the events topic."""
    for p in range(run.cfg.fragments.count):
        v = run.prog.versions.get(p, 0) + 1
        ids = [f"c{p}-{v}"]
        run.store.write(p, v, {"w": np.zeros(2, np.float32)}, {}, {"ids": ids, "tokens": tokens})
        run.apply_event({"kind": "merge", "eid": f"m{p}-{v}", "fragment": p, "version": v, "ids": ids, "time": 0.0})


def test_the_runner_adds_the_joins_at_their_share_of_the_budget_and_stops_everyone_at_the_budget(tmp_path):
    import signal

    jobs = _Jobs()
    run = _budget_run(tmp_path, jobs)
    cfg = run.cfg
    _merge(run, 296)                              # 296 of 1000 merged: no join is due yet
    run.follow_budget(0.0)
    assert run.members == cfg.learner_ids() and not jobs.signals
    _merge(run, 6)                                # 302: the first join (30%) is due, the second (50%) is not
    run.follow_budget(1.0)
    assert run.members[4:] == ["us-2", "us-3"] and set(jobs.jobs) == {"us-2", "us-3"}
    run.follow_budget(2.0)                        # carried out once
    assert len(run.members) == 6
    _merge(run, 694)                              # 996 of 1000
    run.procs.finished.add("us-1")                # finished at its own inner.steps
    run.follow_budget(3.0)
    assert not jobs.signals and run.members[6:] == ["eu-2"]
    _merge(run, 4)                                # 1000: everyone still running is asked to stop
    run.follow_budget(4.0)
    stopped = {"us-0", "eu-0", "eu-1", "us-2", "us-3", "eu-2"}
    assert sorted(jobs.signals) == sorted((lid, signal.SIGTERM) for lid in stopped) and run.procs.removing == stopped
    run.follow_budget(5.0)                        # asked once
    assert len(jobs.signals) == len(stopped)


def test_only_merges_the_store_holds_count_towards_the_budget_never_claimed_tokens(tmp_path):
    """One forged heartbeat claiming 2^52 tokens stopped every learner (the budget summed the
    heartbeats' claims); forged merge events counted too. Now the budget counts what the syncer
    stored with each version, and a merge event the store does not back is skipped."""
    jobs = _Jobs()
    run = _budget_run(tmp_path, jobs)
    _beat(run, "us-0", 2 ** 52)
    run.follow_budget(0.0)
    assert not jobs.signals and not run.procs.removing and run.members == run.cfg.learner_ids()
    _merge(run, 100)
    forged = [{"fragment": 0, "version": 9, "ids": ["c0-9"]},        # a version that does not exist
              {"fragment": 0, "version": 1, "ids": ["mine"]},        # a stored version, other contributions
              {"fragment": 7, "version": 1, "ids": ["c7-1"]}]        # no such fragment
    for i, ev in enumerate(forged):
        with pytest.raises(KeyError):
            run.apply_event({"kind": "merge", "eid": f"forged-{i}", "time": 0.0, **ev})
    assert run.prog.merged_tokens(run.cfg.fragments.count) == 100
    with pytest.raises(KeyError, match="store does not hold"):  # what the evals and the table follow
        run.apply_event({"kind": "syncer_started", "eid": "forged-s", "time": 0.0, "shard": 0,
                          "versions": {"0": 10 ** 6}})
    assert run.prog.versions == {p: 1 for p in range(run.cfg.fragments.count)}
    run.follow_budget(1.0)
    assert not jobs.signals and len(run.members) == 4  # 10%: no join due, nobody stopped


def test_forged_merge_events_cost_the_runner_no_store_reads_beyond_one_per_real_version(tmp_path):
    """Issue 53 L6: every merge event cost the runner's loop a store read (with retries), whatever it
    named. A version past the store's commit marker is refused without reading it, and a real version
    is read once however many events name it."""
    run = _budget_run(tmp_path, _Jobs())
    _merge(run, 100)
    for p in range(run.cfg.fragments.count):
        run.store.mark_committed(p, 1)
    reads = []
    read_meta = run.store.read_meta
    run.store.read_meta = lambda p, v: reads.append((p, v)) or read_meta(p, v)
    run.apply_event({"kind": "merge", "eid": "again", "fragment": 0, "version": 1, "ids": ["c0-1"], "time": 0.0})
    for i in range(50):
        for ev in ({"fragment": 0, "version": 1, "ids": ["mine"]}, {"fragment": 1, "version": 10 ** 6 + i, "ids": ["x"]}):
            with pytest.raises(KeyError, match="does not match|past the store's commit marker"):
                run.apply_event({"kind": "merge", "eid": f"forged-{i}-{ev['fragment']}", "time": 0.0, **ev})
    assert reads == [] and run.prog.merged_tokens(run.cfg.fragments.count) == 100   # read when first merged
    _merge(run, 50)                                        # the real next versions still count
    assert run.prog.merged_tokens(run.cfg.fragments.count) == 150 and len(reads) == run.cfg.fragments.count


@pytest.mark.integration
def test_a_heartbeat_past_its_learners_schedule_or_claiming_absurd_tokens_is_skipped(tmp_path, redis_url):
    """A forged heartbeat at step 10^12 made the next restart of that learner train nothing, and
    one claiming 2^52 tokens counted in the summary; the runner skips both (counted as bad events).
    One at the schedule's very end passes those checks and made the restart train nothing all the same:
    it is taken in as news, and moves no resume point."""
    run = _budget_run(tmp_path, _Jobs(), redis_url)
    good = {"kind": "heartbeat", "eid": "a", "learner": "us-0", "incarnation": "1", "step": 10, "tokens": 640,
            "time": 0.0}
    run.apply_event(good)
    for i, bad in enumerate(({"step": run.cfg.learner_steps("us-0") + 1}, {"step": 10 ** 12}, {"tokens": 2 ** 52},
                             {"incarnation": "forged", "tokens": 2 ** 40})):
        with pytest.raises(ValueError, match="schedule ends|claims"):
            run.apply_event({**good, "eid": f"b{i}", **bad})
    assert run.prog.learners["us-0"]["step"] == 10 and run.prog.tokens() == 640
    # a beat at its schedule's very end (within the bound) that says it handed in everything is taken in
    # as the learner's news, but it is a claim: us-0 starts where the syncer's records leave it (none)
    end = run.cfg.learner_steps("us-0")
    run.apply_event({**good, "eid": "c", "step": end, "handed_in_to": end})
    assert run.prog.learners["us-0"]["step"] == end and run.prog.handed_in["us-0"] == end
    run.procs.start("us-0")
    assert run.jobs.jobs["us-0"][-2:] == ["--start-step", "0"]


def test_a_runner_started_again_on_a_live_run_keeps_who_left_down_and_takes_on_the_joiners(tmp_path):
    """A region flow run started again by hand restarted learners that had left or finished, and
    forgot the ones added at run time. From the events it caught up on: us-1 left (removed by an
    operator), us-0 finished by its last heartbeat, us-2 joined and is training, us-3 joined and
    finished, eu-0 (another region's) is not this runner's, and a dropped eu learner is not ours."""
    cfg = build_config({**BUDGET, "run": {"id": "rerun"}})
    run = RunSupervisor(cfg, tmp_path / "config.yaml", SimpleNamespace(dir=tmp_path), _Jobs(), None, Console(quiet=True),
                   [], regions=("us",))
    events = [("learner_admitted", "us-2", 1.0), ("learner_admitted", "us-3", 2.0), ("learner_left", "us-1", 3.0),
              ("learner_finished", "us-3", 4.0), ("learner_dropped", "eu-1", 5.0), ("learner_admitted", "eu-2", 6.0)]
    for i, (kind, lid, t) in enumerate(events):
        run.prog.apply({"kind": kind, "eid": f"m{i}", "learner": lid, "time": t})
    for lid, state in (("us-0", "finished"), ("us-2", "running"), ("eu-0", "finished")):
        run.prog.apply({"kind": "heartbeat", "eid": f"hb-{lid}", "learner": lid, "step": 5, "state": state})
    run.resume_membership()
    assert run.members == ["us-0", "us-1", "us-2", "us-3"]
    assert run.procs.finished == {"us-0", "us-1", "us-3"}    # started: us-2 only


def test_without_a_budget_the_runner_leaves_the_learners_alone(tmp_path):
    cfg = build_config({"regions": BUDGET["regions"]})
    jobs = _Jobs()
    run = RunSupervisor(cfg, tmp_path / "config.yaml", None, jobs, None, Console(quiet=True), [])
    for lid in cfg.learner_ids():
        _beat(run, lid, 10**9)
    run.follow_budget(0.0)
    assert not jobs.signals and not run.procs.removing


def test_requests_are_answered_once_and_bad_ones_are_seen_as_bad(tmp_path):
    answer = membership.submit(tmp_path, {"op": "add", "region": "eu"})
    (tmp_path / membership.CONTROL / "junk.json").write_text("[1, 2")
    found = membership.pending(tmp_path)
    assert [op for _, op in found] == [{"op": "add", "region": "eu"}, None]
    membership.answer(found[0][0], {"ok": True, "added": ["eu-1"]})
    membership.answer(found[1][0], {"ok": False, "error": "not JSON"})
    assert membership.pending(tmp_path) == []
    assert membership.wait(answer, 1) == {"ok": True, "added": ["eu-1"]}
    with pytest.raises(membership.RequestError, match="not JSON"):
        membership.wait(found[1][0].with_name("junk.answer.json"), 1)
    with pytest.raises(membership.RequestError, match="no answer"):
        membership.wait(tmp_path / "nothing.answer.json", 0.2)


@pytest.mark.integration
def test_a_live_run_grows_from_two_learners_to_four_and_one_leaves(tiny_config, tmp_path):
    """2 learners start; 2 join while they train (one per region, each with its own shard) and one of
    the starting ones is asked to leave. Every contribution is accounted for exactly, every learner
    that was ever a member contributed to a merge, the syncer admitted the joiners and heard the one
    that left say so, and a request past a region's bounds is refused."""
    cfg = tiny_config(regions=[{"name": "us", "learners": 1, "max_learners": 2, "speed": 0.25},
                               {"name": "eu", "learners": 1, "max_learners": 2, "min_learners": 2, "speed": 0.25}],
                      # a joiner's first heartbeat comes ~15 s after its start (JAX, compilation): the
                      # starting learners train long enough (25 s of compute) to meet the joiners; quorum 1
                      # with 4 learners moves a fragment ~4 versions a sync period: staleness is not under test
                      inner={"steps": 400, "max_seconds": 25},
                      syncer={"quorum": 1, "scale_partial_rounds": True, "max_staleness": 1000},
                      outer={"lr": 1.0, "momentum": 0.0}, fragments={"apply": "rebase"})
    answers: dict[str, object] = {}

    def operate() -> None:
        run_dir = _wait_for_run_dir(Path(cfg.run.dir))
        state = _wait_for_merges(run_dir, 1)
        # a fragment's first merge can come before any heartbeat past step 0 (fragments sync staggered,
        # heartbeats every 0.5 s): wait until every learner has said it is past its first sync
        _wait_until(lambda: len(reg := state.registry()) >= 2 and min(hb.get("step", 0) for hb in reg.values())
                    > cfg.fragments.sync_every, "no heartbeat past the first sync")
        answers["add_us"] = membership.wait(membership.submit(run_dir, {"op": "add", "region": "us"}))
        answers["add_eu"] = membership.wait(membership.submit(run_dir, {"op": "add", "region": "eu", "count": 1}))
        try:
            membership.wait(membership.submit(run_dir, {"op": "add", "region": "eu"}))
        except membership.RequestError as err:
            answers["too_many"] = str(err)
        _wait_until(lambda: {"us-1", "eu-1"} <= set(state.members()), "the joiners were not admitted")
        answers["remove"] = membership.wait(membership.submit(run_dir, {"op": "remove", "learner": "us-0"}))
        try:
            membership.wait(membership.submit(run_dir, {"op": "remove", "learner": "eu-0"}))
        except membership.RequestError as err:
            answers["below_min"] = str(err)

    operator = threading.Thread(target=operate, daemon=True)
    operator.start()
    summary = train(cfg, progress=False, console=Console(quiet=True))
    operator.join(timeout=5)
    assert answers["add_us"]["added"] == ["us-1"] and answers["add_eu"]["added"] == ["eu-1"]
    assert answers["add_us"]["start_step"] > 0      # joiners enter the schedule where the run is
    assert "may have 2 learners" in answers["too_many"]
    assert answers["remove"] == {"ok": True, "removed": "us-0"}
    assert "keeps at least 2" in answers["below_min"]

    c = summary["contributions"]
    assert c["published"] == c["accepted"] == c["applied"] > 0 and c["rejected"] == 0 and c["applied_twice"] == 0, c
    state, _, _ = assert_exact_accounting(cfg, summary["run_id"])
    members = {"us-0", "eu-0", "us-1", "eu-1"}
    assert set(summary["members"]) == members and set(state.members()) == {"us-1", "eu-1"}
    assert {lid for m in state.merges() for lid in m["learners"]} == members  # every member contributed
    learners = summary["learners"]
    assert learners["us-0"]["state"] == "left" and learners["us-0"]["step"] < cfg.inner.steps
    assert all(learners[lid]["state"] == "finished" for lid in members - {"us-0"})
    events = run_events(cfg, summary["run_id"])
    regions = [(e["kind"], e["region"], e["live"]) for e in events if e["kind"].startswith("region_")]
    assert regions[:2] == [("region_below_min", "eu", 1), ("region_at_min", "eu", 2)]  # min 2: eu-1 made it 2
    kinds = [(e["kind"], e.get("learner")) for e in events]
    assert ("learner_admitted", "us-1") in kinds and ("learner_admitted", "eu-1") in kinds
    assert ("learner_left", "us-0") in kinds
    peak = max(p["members"] for p in summary["membership"])
    assert summary["membership"][0]["members"] == 2 and peak >= 3


@pytest.mark.integration
def test_a_run_with_a_token_budget_adds_its_scheduled_joiner_and_stops_everyone_at_the_budget(tiny_config):
    """2 slow learners that could train 1000 steps each; a learner joins at 5% of a budget of 500 steps
    per starting learner. The syncer takes no contribution into a fragment that has taken in the budget,
    so each fragment ends within one contribution of it however late the runner asks everyone to stop
    (a loaded machine made that lag, and the old bound on it, arbitrary): all say left, every
    contribution is accounted for, and the joiner contributed."""
    per_step = 8 * 32
    budget = 2 * 500 * per_step
    cfg = tiny_config(regions=[{"name": "us", "learners": 1, "max_learners": 2, "speed": 0.25},
                               {"name": "eu", "learners": 1, "speed": 0.25}],
                      inner={"steps": 1000}, syncer={"quorum": 1, "scale_partial_rounds": True},
                      outer={"lr": 1.0, "momentum": 0.0}, fragments={"apply": "rebase"},
                      run={"token_budget": budget, "joins": [{"at_tokens_fraction": 0.05, "region": "us"}]})
    summary = train(cfg, progress=False, console=Console(quiet=True))
    assert summary["members"] == ["us-0", "eu-0", "us-1"]
    learners = summary["learners"]
    assert all(learners[lid]["state"] == "left" and learners[lid]["step"] < cfg.inner.steps for lid in learners)
    state, _, status = assert_exact_accounting(cfg, summary["run_id"])
    merges = state.merges()
    for p in range(cfg.fragments.count):
        mine = [m for m in merges if m["fragment"] == p]
        merged = sum(m["tokens"] for m in mine)
        # the last contribution accepted into p is in its last merge, and p had taken in less than the
        # budget before it: so without the largest of that merge, p holds less than the budget
        assert merged - max(mine[-1]["tokens_each"]) < budget, (p, merged, mine[-1]["tokens_each"])
    assert budget <= sum(m["tokens"] for m in merges) // cfg.fragments.count
    events = run_events(cfg, summary["run_id"])
    refused = {e["id"] for e in events if e["kind"] == "contribution_rejected" and e["reason"] == "token_budget"}
    assert all(status[cid] == "rejected:token_budget" for cid in refused)
    assert {lid for m in merges for lid in m["learners"]} == {"us-0", "eu-0", "us-1"}
    kinds = [(e["kind"], e.get("learner")) for e in events]
    assert ("learner_admitted", "us-1") in kinds and ("learner_left", "us-1") in kinds


@pytest.mark.integration
def test_the_syncer_takes_no_contribution_into_a_fragment_that_has_taken_in_the_budget_even_after_a_restart(
        tiny_config):
    """The budget is the syncer's rule, not the runner's timing: a fragment takes contributions while it
    has taken in (merged or accepted) less than run.token_budget tokens, then refuses new ones as
    `token_budget`; an accepted one replayed after a restart is never refused, and a restarted syncer
    counts what the merges already hold."""
    from helpers import Harness

    cfg = tiny_config(syncer={"quorum": 2, "grace_max_s": 0.0}, run={"token_budget": 1000})
    h = Harness(cfg, f"budget-{time.time_ns() % 10**9}")
    status = lambda cid: h.state.statuses().get(cid, "")  # noqa: E731
    first = h.publish("us-0", 0, tokens=600, steps=10)
    h.pump(lambda: status(first.id).startswith("pending"))
    h.syncer = h.new_syncer()                      # restart: the pending one comes back from the log
    second = h.publish("eu-0", 0, tokens=600, steps=10)
    h.pump(lambda: status(second.id).startswith("applied"))
    assert status(first.id).startswith("applied")  # 600 < 1000 when each was taken: both merged, 1200
    over = h.publish("us-0", 0, base_version=1, tokens=10)
    h.pump(lambda: status(over.id).startswith("rejected"))
    assert status(over.id) == "rejected:token_budget"
    other = h.publish("us-0", 1, tokens=10)        # the budget is per fragment: fragment 1 has taken nothing
    h.pump(lambda: status(other.id).startswith("pending"))
    h.syncer = h.new_syncer()                      # a restarted syncer reads fragment 0's 1200 from the merges
    late = h.publish("eu-0", 0, base_version=1, tokens=10)
    h.pump(lambda: status(late.id).startswith("rejected"))
    assert status(late.id) == "rejected:token_budget"
    assert sum(m["tokens"] for m in h.state.merges() if m["fragment"] == 0) == 1200


def _wait_for_run_dir(root: Path, timeout_s: float = 120.0) -> Path:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        found = [d for d in root.glob("*") if (d / "config.yaml").is_file()]
        if found:
            return found[0]
        time.sleep(0.2)
    raise TimeoutError(f"no run directory under {root}")


def _wait_for_merges(run_dir: Path, n: int):
    """The run's Redis state, once it holds n merges."""
    from diloco.config import load_config
    from diloco.syncer import state as state_mod

    cfg = load_config(run_dir / "config.yaml")
    state = state_mod.SyncerState(state_mod.connect(cfg.state), cfg.state.key_prefix, cfg.run.id)
    _wait_until(lambda: len(state.merges()) >= n, f"fewer than {n} merges")
    return state


def _wait_until(condition, what: str, timeout_s: float = 180.0) -> None:
    deadline = time.time() + timeout_s
    while not condition():
        if time.time() > deadline:
            raise TimeoutError(f"{what} in {timeout_s:.0f}s")
        time.sleep(0.2)


def test_a_request_of_any_shape_gets_an_answer_and_the_runner_goes_on(tmp_path):
    """`learners remove '[/]'` raised rich's MarkupError, and {"op": "add", "region": ["us"]} a TypeError,
    out of serve_requests: the run stopped and the unanswered request killed the next runner too."""
    cfg = build_config(BUDGET)
    run = RunSupervisor(cfg, tmp_path / "config.yaml", SimpleNamespace(dir=tmp_path), _Jobs(), None, Console(), [])
    asks = [{"op": "remove", "learner": "[/]"}, {"op": "remove", "learner": "[/x]"}, {"op": "add", "region": ["us"]},
            {"op": "add", "region": "us", "count": "[bold]"}, {"op": ["add"]}, [1, 2], "[/]", None]
    answers = [membership.submit(tmp_path, op) for op in asks]
    run.serve_requests(0.0)
    assert membership.pending(tmp_path) == []
    for path in answers:
        got = json.loads(path.read_text())
        assert got["ok"] is False and got["error"], got


def test_forged_events_are_skipped_by_the_runner_not_fatal_to_it():
    from diloco.progress import Progress, progress_table
    prog = Progress()
    for bad in ({"kind": "contribution_rejected", "eid": "a", "reason": 7},
                {"kind": "contribution_rejected", "eid": "b", "reason": "x" * 1000},
                {"kind": "learner_left", "eid": "c", "learner": "us-0", "time": "later"},
                {"kind": "merge", "eid": "d", "fragment": "0", "version": 1, "ids": []}):
        with pytest.raises(ValueError):
            prog.apply(bad)
    prog.apply({"kind": "contribution_rejected", "eid": "e", "reason": "[/]"})   # a string: shown as text
    cfg = build_config(BUDGET)
    Console(file=io.StringIO()).print(progress_table(cfg, prog, "r", 1.0))
    assert prog.rejections == {"[/]": 1} and prog.membership == []


def test_a_fifo_in_the_control_folder_is_answered_as_bad_not_read(tmp_path):
    import os
    (tmp_path / membership.CONTROL).mkdir()
    fifo = tmp_path / membership.CONTROL / "stuck.json"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(membership.pending(tmp_path)), daemon=True)
    reader.start()
    reader.join(timeout=5)
    assert not reader.is_alive(), "reading the control folder blocked on a FIFO"
    assert got == [[(fifo, None)]]


@pytest.mark.integration
def test_a_run_outlives_a_hostile_operator_and_forged_events_with_exact_accounting(tiny_config):
    """Mid-run, an operator asks `learners remove '[/]'` (rich markup), and a writer of the events
    topic forges a heartbeat with 2^52 tokens at step 10^12, rejections with a numeric and a markup
    reason and a merge of a version that does not exist. The run (live table on) trains to the end:
    nobody is stopped by the budget the forged tokens would pass, every contribution is accounted for
    once, and the summary counts the forged events as bad."""
    from diloco.infra import kafka as kafka_io
    from diloco import messages

    steps, per_step = 120, 8 * 32
    cfg = tiny_config(regions=[{"name": "us", "learners": 1, "speed": 0.5}, {"name": "eu", "learners": 1, "speed": 0.5}],
                      inner={"steps": steps}, run={"token_budget": 100 * 2 * steps * per_step})
    seen: dict[str, object] = {}

    def operate() -> None:
        run_dir = _wait_for_run_dir(Path(cfg.run.dir))
        _wait_for_merges(run_dir, 1)
        run_id = run_dir.name
        try:
            membership.wait(membership.submit(run_dir, {"op": "remove", "learner": "[/]"}))
        except membership.RequestError as err:
            seen["remove"] = str(err)
        producer = kafka_io.producer(cfg.transport)
        topic = kafka_io.Topics.for_run(cfg, run_id).events
        forged = [messages.event("heartbeat", run=run_id, learner="us-0", incarnation="x", step=10 ** 12,
                                 tokens=2 ** 52, state="running"),
                  messages.event("contribution_rejected", run=run_id, source="syncer", id="f1", reason=7),
                  messages.event("contribution_rejected", run=run_id, source="syncer", id="f2", reason="[/]"),
                  messages.event("merge", run=run_id, source="syncer", fragment=0, version=10 ** 6, ids=["f3"],
                                 tokens=2 ** 40)]
        for value in forged:
            producer.send(topic, value, partition=0)
        producer.flush()
        producer.close()
        seen["forged"] = [json.loads(value)["eid"] for value in forged]

    operator = threading.Thread(target=operate, daemon=True)
    operator.start()
    summary = train(cfg, progress=True, console=Console(file=io.StringIO(), width=120))
    operator.join(timeout=30)
    assert len(seen.get("forged", ())) == 4 and "[/]" in seen.get("remove", ""), seen
    learners = summary["learners"]
    assert all(learners[lid]["state"] == "finished" and learners[lid]["step"] == steps for lid in learners), learners
    assert summary["tokens"] == 2 * steps * per_step          # the claim of 2^52 is not among them
    assert summary["bad_events"] >= 3                         # the heartbeat, the numeric reason, the merge
    c = summary["contributions"]
    assert c["applied_twice"] == 0 and c["pending"] == 0 and c["published"] == c["applied"] + c["rejected"]
    assert_exact_accounting(cfg, summary["run_id"], forged=seen["forged"])


def test_a_request_nested_deeper_than_json_reads_is_answered_as_bad(tmp_path):
    """A request file of 2,000 nested brackets raised RecursionError out of `pending` (outside
    serve_requests' try): the runner died, and the next one on the same folder too."""
    (tmp_path / membership.CONTROL).mkdir()
    deep = tmp_path / membership.CONTROL / "deep.json"
    deep.write_text("[" * 2000 + "]" * 2000)   # within the 4 KiB a request may have
    assert membership.pending(tmp_path) == [(deep, None)]


def test_the_runner_remembers_a_bounded_number_of_event_ids_and_refuses_ids_that_are_not_short_strings():
    """Every event id stayed in a set for the run's life, and an id could be any JSON up to 1 MiB: a
    writer of the events topic grew the runner by a megabyte an event. Ids are short strings, those of
    the newest are kept up to a bound, oldest out first."""
    from diloco.progress import REMEMBERED_EIDS, Progress

    prog = Progress()
    for eid in (None, 7, ["x"], "x" * 65, ""):
        with pytest.raises(ValueError, match="event id"):
            prog.apply({"kind": "merge", "eid": eid, "fragment": 0, "version": 1, "ids": []})
    merge = {"kind": "merge", "eid": "m-1", "fragment": 0, "version": 1, "ids": ["c1"]}
    prog.apply(merge)
    prog.apply(merge)                                          # at-least-once delivery: taken once
    assert prog.merges == 1 and prog.merged_ids == ["c1"]
    for i in range(REMEMBERED_EIDS + 10):
        prog.apply({"kind": "learner_left", "eid": f"e-{i}", "learner": "us-0", "time": 0.0})
    assert len(prog.eids) == REMEMBERED_EIDS and "m-1" not in prog.eids and f"e-{REMEMBERED_EIDS + 9}" in prog.eids


@pytest.mark.integration
def test_a_forged_heartbeat_or_acceptance_on_the_events_topic_moves_no_resume_point(tiny_config):
    """Issue 53 H2: one heartbeat {step: end, handed_in_to: end} or one contribution_accepted with cursor
    [0, end], sent by a plain Kafka client, made us-0's next restart (or the spare taking its place)
    start at its last step and train nothing. The runner reads both (they are well formed), and
    resumes us-0 where the syncer's records leave it: past the furthest cursor the syncer accepted,
    merged (step 20 on fragment 1) or pending (step 24 on fragment 0); the forged claims only hold the
    restart for resume.SETTLE_S while the records do not reach them."""
    from diloco import messages, resume
    from diloco.run import events_from_start
    from helpers import Harness

    run_id = f"forged-resume-{time.time_ns() % 10 ** 8}"
    cfg = tiny_config(run={"id": run_id}, regions=[{"name": "us", "learners": 1}, {"name": "eu", "learners": 1}])
    h = Harness(cfg, run_id, in_process=False)
    contribution = {"learner": "us-0", "region": "us", "base_version": 0, "tokens": 100, "steps": 4, "step_time": 0.1,
                    "bytes": 10, "arrival": 0.0, "topic": h.topics.fragments["us"], "partition": 0, "offset": 0,
                    "created": 0.0}
    h.state.accept(0, "a-24", {**contribution, "id": "a-24", "fragment": 0, "cursor": [20, 24]}, {})
    h.state.commit_merge(1, from_version=0, ids=[], late=0, offsets={}, sync_time_s=0.0,
                         record={"fragment": 1, "version": 1, "ids": ["m-20"], "learners": ["us-0", "eu-0"],
                                 "tokens": 200, "tokens_each": [100, 100], "cursors": [[0, 20], [0, 30]]})
    end = cfg.learner_steps("us-0")
    forged = [messages.event("heartbeat", run=run_id, source="learner", learner="us-0", incarnation="x", step=end,
                             handed_in_to=end, tokens=end, state="running"),
              messages.event("contribution_accepted", run=run_id, source="syncer", id="f", learner="us-0",
                             region="us", fragment=0, base_version=0, version=1, tokens=1, bytes=1, cursor=[0, end])]
    for value in forged:
        h.producer.send(h.topics.events, value, partition=0)
    h.producer.flush()
    jobs = _Jobs()
    jobs.jobs["us-0"] = []  # started before: its restart is what the forged events aimed at
    run = RunSupervisor(cfg, Path("config.yaml"), SimpleNamespace(dir=Path("corpus")), jobs, events_from_start(cfg),
                        Console(quiet=True), [], syncer=False, state=h.state)
    try:
        deadline = time.time() + 30
        while run.prog.accepted < 1 or "us-0" not in run.prog.learners:
            assert time.time() < deadline, "the forged events did not arrive"
            run._pump(200)
        assert run.bad_events == 0 and run.prog.handed_in["us-0"] == end    # well formed: read as news
        assert run.accepted_end("us-0") == 24 and run.accepted_end("eu-0") == 30
        assert run.resume_point("us-0", 0.0, wait=False) == 24
        now = time.time()
        run.procs._down("us-0", now, 0.0, "killed")
    finally:
        run.events.close()
    run.procs.restart_due(now)                                # the claims are past the records: it waits
    assert jobs.jobs["us-0"] == [] and "us-0" in run.procs.restart_at
    run.procs.restart_due(now + resume.SETTLE_S)              # and then resumes where the records say
    assert jobs.jobs["us-0"][-2:] == ["--start-step", "24"] and run.procs.restarts == {"us-0": 1}
    assert run.resume_point("eu-0", now, wait=True) == 30     # no claim past its records: no wait


@pytest.mark.integration
def test_a_restart_waits_until_the_syncer_has_read_what_the_dead_learner_wrote(tiny_config):
    """Issue 53 item 4: us-0 published its delta of steps [0, 8) and died before the syncer read it (a
    loaded machine: seen in test_spares, where the spare resumed at 20 and [17, 27) was accepted
    after). Resuming from the records as they stood would start at 0, and steps 0-8 would reach the
    global twice once the syncer accepted the delta. The runner takes the region topic's end offsets
    when it learns of the death and resumes only once the syncer's read_to positions pass them: at 8."""
    from diloco.run import events_from_start
    from helpers import Harness

    run_id = f"read-up-{time.time_ns() % 10 ** 8}"
    cfg = tiny_config(run={"id": run_id}, regions=[{"name": "us", "learners": 1}, {"name": "eu", "learners": 1}])
    h = Harness(cfg, run_id)            # its syncer runs in this process, stepped by hand below
    h.syncer.save_offsets(force=True)  # where it stands before the delta
    h.publish(learner="us-0", fragment=0, steps=8, tokens=512, cursor=(0, 8))
    jobs = _Jobs()
    jobs.jobs["us-0"] = []
    run = RunSupervisor(cfg, Path("config.yaml"), SimpleNamespace(dir=Path("corpus")), jobs, events_from_start(cfg),
                        Console(quiet=True), [], syncer=False, state=h.state)
    try:
        now = time.time()
        run.procs._down("us-0", now, 0.0, "killed")
        assert run.accepted_end("us-0") is None             # the records alone would resume it at 0
        run.procs.restart_due(now)
        assert jobs.jobs["us-0"] == [] and "us-0" in run.procs.restart_at  # the syncer has not read it yet: wait
        deadline = time.time() + 30
        while not h.state.pending(cfg.fragments.count):
            assert time.time() < deadline, "the syncer did not accept the delta"
            h.syncer.step()
        h.syncer.save_offsets(force=True)
        run.procs.restart_due(now)
    finally:
        run.events.close()
    assert jobs.jobs["us-0"][-2:] == ["--start-step", "8"]


def test_the_coverage_ledger_measures_each_learner_against_the_schedule_the_runner_set(tmp_path):
    """Joiners from the step they entered at; those the runner asked to stop up to what they handed in;
    the rest to their schedule's end, whatever their beats say."""
    run = _budget_run(tmp_path, _Jobs())
    end = run.cfg.learner_steps("us-0")
    for lid, step in (("us-0", 30), ("us-1", 30), ("eu-0", 10)):
        run.apply_event({"kind": "heartbeat", "eid": lid, "learner": lid, "incarnation": "1", "step": step, "time": 0.0})
    assert run.carry_out({"op": "add", "region": "us", "count": 1}, 0.0) == {"added": ["us-2"], "start_step": 30}
    assert run.jobs.jobs["us-2"][-2:] == ["--start-step", "30"]
    run.apply_event({"kind": "heartbeat", "eid": "f", "learner": "eu-0", "incarnation": "x", "step": end,
                     "handed_in_to": end, "time": 0.0})   # a claim: eu-0's schedule is still [0, end)
    run.carry_out({"op": "remove", "learner": "us-1"}, 1.0)
    assert run.schedules() == {"us-0": (0, end), "us-1": (0, None), "eu-0": (0, end), "eu-1": (0, end),
                               "us-2": (30, run.cfg.learner_steps("us-2"))}
