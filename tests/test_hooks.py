"""The run supervisor's hooks (diloco.hooks, Drain of diloco.supervisor, the processes' reap and
restart_due of diloco.processes), each driven on its own with made-up times: no services, no
processes, a backend that records what it is asked. Live runs of the whole loop are in
test_resilience, test_spares, test_membership and test_flows."""

from __future__ import annotations

import io
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import NoRecords
from rich.console import Console

from diloco import chaos, hooks, membership
from diloco.config import build_config
from diloco.ledger import RunLedger
from diloco.processes import Outage, Processes, outage_seconds
from diloco.progress import Progress
from diloco.supervisor import Drain, RunError, RunSupervisor

REGIONS = [{"name": "us", "learners": 2, "max_learners": 3}, {"name": "eu", "learners": 1, "max_learners": 2}]


class Jobs:
    """A JobBackend that starts nothing: it records starts and signals, and exits what `exit` says."""

    def __init__(self):
        self.started, self.signals, self.exits = [], [], {}

    def start(self, name, argv, env=None, processes=1):
        self.started.append((name, argv[argv.index("--start-step") + 1] if "--start-step" in argv else None))
        self.exits.pop(name, None)

    def has(self, name):
        return any(n == name for n, _ in self.started)

    def poll(self, name):
        return self.exits.get(name)

    def signal(self, name, sig=signal.SIGTERM):
        self.signals.append((name, sig))

    def wait(self, name, timeout=None):
        return self.exits.setdefault(name, -9)

    def tail(self, name, lines=20):
        return f"(the last lines of {name})"

    def where_log(self, name):
        return f"logs/{name}.log"


def runner(tmp_path: Path, regions=None, syncer=True, kills=(), out=None, **run) -> tuple[RunSupervisor, Jobs]:
    cfg = build_config({"regions": REGIONS, "run": {"id": "hooks", "restart_backoff_s": 2.0, "max_restarts": 2, **run}})
    jobs = Jobs()
    sup = RunSupervisor(cfg, tmp_path / "config.yaml", SimpleNamespace(dir=tmp_path), jobs, None,
                        Console(file=out or io.StringIO(), width=200), list(kills), regions=regions, syncer=syncer,
                        state=NoRecords())
    return sup, jobs


def beat(run: RunSupervisor, lid: str, step: int) -> None:
    run.prog.apply({"kind": "heartbeat", "eid": f"{lid}-{step}", "learner": lid, "incarnation": "1", "step": step,
                    "state": "running"})


def test_the_progress_line_shows_at_the_first_pass_then_once_per_period(tmp_path):
    out = io.StringIO()
    run, _ = runner(tmp_path, out=out)
    view = hooks.ProgressView(run, t0=100.0, live=False, line_every_s=10.0)
    shown = []
    for now in (100.0, 105.0, 109.9, 110.0, 115.0, 120.5):
        before = out.getvalue().count("\n")
        view(now)
        shown.append(out.getvalue().count("\n") > before)
    view.close(121.0)
    assert shown == [True, False, False, True, False, True]


def test_chaos_kills_each_target_once_its_own_progress_reached_it_and_waits_while_it_is_down(tmp_path):
    kills = [chaos.Kill("us-0", 0.5), chaos.Kill("us-1", 0.5), chaos.Kill("syncer", 0.25), chaos.Kill("eu-0", 0.1)]
    run, jobs = runner(tmp_path, regions=("us",), kills=kills)
    assert [k.target for k in run.kills] == ["us-0", "us-1", "syncer"]   # eu-0 is another runner's
    half = run.cfg.learner_steps("us-0") // 2
    beat(run, "us-0", half)                                              # us-0 at 50%, us-1 at 0: syncer at 25%
    run.chaos(10.0)
    assert jobs.signals == [("us-0", signal.SIGKILL), ("syncer", signal.SIGKILL)]
    assert run.ledger.kill_counts == {"us-0": 1, "syncer": 1}
    assert run.procs.restart_at["us-0"] == 10.0 + run.cfg.chaos.restart_after_s
    assert [(o.name, o.start, o.end) for o in run.procs.outages] == [("us-0", 10.0, None), ("syncer", 10.0, None)]
    beat(run, "us-1", half)
    run.procs.restart_at["us-1"] = 11.0                                  # down already: its kill stays due
    run.chaos(11.0)
    assert len(jobs.signals) == 2 and [k.target for k in run.kills] == ["us-1"]
    del run.procs.restart_at["us-1"]
    run.draining = True                                                  # nor during the drain
    run.chaos(12.0)
    assert len(jobs.signals) == 2
    run.draining = False
    run.procs.finished.add("us-1")                                       # done: the kill goes, nothing is killed
    run.chaos(13.0)
    assert len(jobs.signals) == 2 and run.kills == []


def test_membership_requests_are_answered_by_their_regions_runner_and_none_while_draining(tmp_path):
    run, jobs = runner(tmp_path, regions=("us",), syncer=False)
    ours = membership.submit(tmp_path, {"op": "add", "region": "us"})
    theirs = membership.submit(tmp_path, {"op": "remove", "learner": "eu-0"})
    run.draining = True
    run.serve_requests(1.0)
    assert not ours.exists() and len(membership.pending(tmp_path)) == 2
    run.draining = False
    run.serve_requests(2.0)
    assert membership.pending(tmp_path)[0][1] == {"op": "remove", "learner": "eu-0"}  # left to eu's runner
    assert ours.exists() and not theirs.exists()
    assert jobs.started == [("us-2", "0")] and run.members == ["us-0", "us-1", "us-2"]
    assert run.ledger.spans["us-2"] == [2.0, None]


def test_the_token_budget_adds_its_runners_joins_and_does_nothing_while_draining(tmp_path):
    joins = [{"at_tokens_fraction": 0.5, "region": "us"}, {"at_tokens_fraction": 0.5, "region": "eu"}]
    run, jobs = runner(tmp_path, regions=("us",), syncer=False, token_budget=100, joins=joins)
    assert [j.region for j in run.follow_budget.joins] == ["us"]
    for p in range(run.cfg.fragments.count):                             # 60 of 100 tokens merged
        run.prog.merged[(p, 1)] = 60
    run.draining = True
    run.follow_budget(1.0)
    assert jobs.started == [] and len(run.follow_budget.joins) == 1
    run.draining = False
    run.follow_budget(2.0)
    assert jobs.started == [("us-2", "0")] and run.follow_budget.joins == []


def test_an_exited_process_restarts_after_its_backoff_and_fails_the_run_past_max_restarts(tmp_path):
    run, jobs = runner(tmp_path, syncer=False)
    for lid in run.members:
        run.procs.start(lid)
    jobs.exits["us-1"] = 0                                               # done: finished, never restarted
    jobs.exits["us-0"] = 1
    run.procs.reap(10.0)
    assert run.procs.finished == {"us-1"} and run.procs.restart_at == {"us-0": 12.0}  # restart_backoff_s * 2 ** 0
    run.procs.restart_due(11.9)
    assert jobs.started.count(("us-0", "0")) == 1
    run.procs.restart_due(12.0)
    assert jobs.started.count(("us-0", "0")) == 2 and run.procs.restarts == {"us-0": 1} and not run.procs.restart_at
    jobs.exits["us-0"] = 1
    run.procs.reap(20.0)
    assert run.procs.restart_at == {"us-0": 24.0}                        # 2 * 2 ** 1
    run.procs.restart_due(24.0)
    jobs.exits["us-0"] = 137
    with pytest.raises(RunError, match=r"us-0 failed 3 times \(last exit 137\); log logs/us-0.log"):
        run.procs.reap(30.0)
    assert outage_seconds(run.procs.outages) == {} and [o.start for o in run.procs.outages] == [10.0, 20.0]


class SpareJobs(Jobs):
    """Jobs that also start warm spares (stdin_pipe), tell them whom to become and rename them."""

    def __init__(self):
        super().__init__()
        self.told, self.renamed = [], []

    def start(self, name, argv, env=None, processes=1, stdin_pipe=False):
        super().start(name, argv, env, processes)

    def tell(self, name, line):
        self.told.append((name, line))

    def rename(self, old, new):
        self.renamed.append((old, new))
        self.started = [(new if n == old else n, s) for n, s in self.started]


def processes_alone(jobs: Jobs, out: io.StringIO, resume_at: dict[str, int], **run) -> tuple[Processes, list]:
    """A processes owner on its own: no supervisor, its resume points from `resume_at`, what it tells
    the run about (downs, leaves) recorded in the list returned with it."""
    cfg = build_config({"regions": REGIONS, "run": {"id": "procs", "restart_backoff_s": 2.0, "max_restarts": 2, **run}})
    told: list = []
    members = [lid for lid in cfg.learner_ids() if cfg.region_of(lid).name == "us"]
    procs = Processes(cfg, Path("config.yaml"), SimpleNamespace(dir=Path("corpus")), jobs,
                      Console(file=out, width=200), RunLedger(), Progress(), syncers=[], members=members,
                      syncers_up=set(), draining=lambda: False,
                      resume_point=lambda name, now, *, wait: told.append(("resume", name, now, wait))
                      or resume_at[name],
                      went_down=lambda name, now: told.append(("down", name, now)),
                      left=lambda name: told.append(("left", name)), spare_prefix="us-")
    return procs, told


def test_the_processes_owner_restarts_an_exit_after_its_backoff_doubling_and_fails_the_run_with_its_log():
    jobs, out = Jobs(), io.StringIO()
    procs, told = processes_alone(jobs, out, {"us-0": 7, "us-1": 0})
    for lid in procs.members:
        procs.start(lid)
    assert jobs.started == [("us-0", "7"), ("us-1", "0")] and [t[3] for t in told] == [False, False]
    told.clear()
    for n, t in enumerate((100.0, 200.0)):                               # the fake clock: each pass's time
        jobs.exits["us-0"] = 1
        procs.reap(t)
        due = t + 2.0 * 2 ** n                                           # restart_backoff_s * 2 ** n
        assert procs.restart_at == {"us-0": due} and ("down", "us-0", t) in told
        assert f"us-0 exited with 1; restarting in {2.0 * 2 ** n:.1f}s" in out.getvalue()
        procs.restart_due(due - 0.1)
        assert len(jobs.started) == 2 + n
        procs.restart_due(due)
        assert jobs.started[-1] == ("us-0", "7") and procs.restarts == {"us-0": n + 1} and not procs.restart_at
        assert told[-1] == ("resume", "us-0", due, True)                 # a restart waits for its resume point
    assert [(o.name, o.start, o.end) for o in procs.outages] == [("us-0", 100.0, None), ("us-0", 200.0, None)]
    procs.close_outage("us-0")                                           # its heartbeat: back
    assert outage_seconds(procs.outages)["us-0"] > 0 and procs.running() == ["us-0", "us-1"]
    jobs.exits["us-0"] = 137                                             # past run.max_restarts = 2
    with pytest.raises(RunError, match=r"us-0 failed 3 times \(last exit 137\); log logs/us-0.log:\n"
                                       r"\(the last lines of us-0\)"):
        procs.reap(300.0)
    procs.ask_to_leave("us-1")                                           # stopped for good: never restarted
    assert ("us-1", signal.SIGTERM) in jobs.signals and told[-1] == ("left", "us-1")
    jobs.exits["us-1"] = 1
    jobs.exits.pop("us-0")
    procs.reap(310.0)
    assert procs.finished == {"us-1"} and procs.ledger.spans["us-1"] == [None, 310.0] and procs.running() == ["us-0"]


def test_the_processes_owner_hands_a_killed_learner_to_a_warm_spare_and_starts_the_next_once_it_is_back():
    jobs, out = SpareJobs(), io.StringIO()
    procs, told = processes_alone(jobs, out, {"us-0": 0, "us-1": 0}, spares=1)
    procs.start_spare()
    for lid in procs.members:
        procs.start(lid)
    procs.prog.learners["us-0"] = {"incarnation": "a", "step": 30}
    procs.kill("us-0", 50.0)
    assert jobs.signals == [("us-0", signal.SIGKILL)] and procs.ledger.kill_counts == {"us-0": 1}
    assert procs.to_spare == {"us-0": ("killed by chaos (SIGKILL)", procs.cfg.chaos.restart_after_s)}
    assert procs.restart_at == {"us-0": 50.0}                            # handed over as soon as it resumes
    procs.restart_due(50.0)
    assert jobs.told == [("us-spare-0", '{"learner": "us-0", "start_step": 0}')]
    assert jobs.renamed == [("us-spare-0", "us-0")] and procs.spares == [] and procs.restarts == {"us-0": 1}
    assert procs.handovers == [{"learner": "us-0", "spare": "us-spare-0", "start_step": 0}]
    assert procs.replaced == {"us-0": "a"} and procs.spares_owed == 1
    assert "us-0 killed by chaos (SIGKILL); us-spare-0 takes its place at step 0" in out.getvalue()
    procs.close_outage("us-0")                                           # the spare's first beat as us-0
    assert procs.outages[0].end is not None and procs.spares == ["us-spare-1"] and procs.spares_owed == 0
    procs.kill("us-1", 60.0)                                             # and a spare that died is dropped
    jobs.exits["us-spare-1"] = 1
    procs.restart_due(60.0)
    assert "us-spare-1 cannot take over (exited with 1); log logs/us-spare-1.log" in out.getvalue()
    assert procs.restart_at == {"us-1": 60.0 + procs.cfg.chaos.restart_after_s} and procs.spares == []
    assert "us-1 killed by chaos (SIGKILL); restarting in" in out.getvalue()


def test_the_drain_waits_for_the_learners_and_the_shards_then_ends_the_loop_or_fails_at_the_deadline(tmp_path):
    run, jobs = runner(tmp_path)
    drain = Drain(run, deadline=100.0)
    run.syncers_up = set(run.syncers)
    run.procs.finished |= {"us-0", "us-1"}
    drain(10.0)                                                          # eu-0 trains on
    assert not run.draining and jobs.signals == [] and run.ledger.learners_done_at is None
    run.procs.finished.add("eu-0")
    run.elsewhere = {"eu"}                                               # another runner is still waited for
    drain(11.0)
    assert not run.draining and run.ledger.learners_done_at is None
    run.elsewhere = set()
    run.procs.restart_at["syncer"] = 12.0                                # a shard is down: not yet
    drain(12.0)
    assert not run.draining and run.ledger.learners_done_at == 12.0
    del run.procs.restart_at["syncer"]
    drain(13.0)
    assert run.draining and jobs.signals == [("syncer", signal.SIGTERM)] and not drain.over
    assert drain.deadline == min(100.0, 13.0 + run.cfg.syncer.drain_timeout_s + 60)
    run.procs.finished.add("syncer")
    drain(14.0)
    assert drain.over and jobs.signals == [("syncer", signal.SIGTERM)]
    late = Drain(runner(tmp_path)[0], deadline=100.0)
    late(100.0)
    with pytest.raises(RunError, match="did not finish within run.timeout_s"):
        late(100.5)


def test_an_outage_lasts_from_the_exit_to_the_next_sign_of_life():
    assert outage_seconds([Outage("us-0", 1.0, 3.456), Outage("syncer", 2.0), Outage("eu-0", 0.0, 0.5)]) == \
        {"us-0": 2.46, "eu-0": 0.5}


def test_the_run_flows_regions_hook_asks_prefect_every_two_seconds_and_announces_each_step_of_versions(
        tmp_path, monkeypatch):
    from diloco.flows import training

    run, _ = runner(tmp_path, regions=())
    now = [0.0]
    regions = training.Regions(SimpleNamespace(cfg=run.cfg, cfg_path=tmp_path / "config.yaml"), 2, None,
                               clock=lambda: now[0])
    regions.flow_runs = {"us": None, "eu": None}                         # submitted already
    followed, announced = [], []
    monkeypatch.setattr(regions, "follow", lambda r: followed.append(now[0]))
    monkeypatch.setattr(training, "emit_event", lambda event, resource, payload: announced.append(payload["versions"]))
    P = run.cfg.fragments.count
    for t, version in ((0.0, 1), (1.0, 2), (1.9, 2), (2.0, 3), (3.5, 4), (4.0, 4)):
        now[0] = t
        run.prog.versions = {p: version for p in range(P)}
        regions(run)
    assert followed == [0.0, 2.0, 4.0]
    assert announced == [[2] * P, [4] * P]                               # each time every fragment gained 2


def test_a_region_runners_restart_log_says_each_restart_once():
    from diloco.flows.training import RestartLog

    said = []
    restart_log = RestartLog(SimpleNamespace(warning=said.append))
    run = SimpleNamespace(procs=SimpleNamespace(restarts={}), cfg=build_config({"run": {"max_restarts": 3}}))
    for restarts in ({}, {"us-0": 1}, {"us-0": 1}, {"us-0": 2, "us-1": 1}):
        run.procs.restarts = dict(restarts)
        restart_log(run)
    assert said == ["restarted us-0 (restart 1 of at most 3)", "restarted us-0 (restart 2 of at most 3)",
                    "restarted us-1 (restart 1 of at most 3)"]


def test_the_ledger_sets_merged_compute_against_spent_compute_and_time_in_the_run():
    ledger = RunLedger()
    ledger.beat({"learner": "us-0", "incarnation": "a", "compute_s": 8.0, "at": 100.0, "time": 100.5}, now=100.0)
    ledger.beat({"learner": "eu-0", "incarnation": "a", "compute_s": 10.0, "time": 101.0}, now=101.0)
    ledger.killed("us-0", {"incarnation": "a", "state": "running"}, now=102.0)  # 2 s past its last figures
    ledger.killed("eu-0", {"incarnation": "x", "state": "running"}, now=102.0)  # no figures of that one: no tail
    ledger.killed("syncer", None, now=103.0)
    ledger.beat({"learner": "us-0", "incarnation": "b", "compute_s": 4.0, "time": 110.0}, now=110.0)
    ledger.spans["eu-1"] = [105.0, 115.0]                                # added at 105, asked to leave at 115
    ledger.learners_done_at = 120.0
    merges = [{"learners": ["us-0", "eu-0"], "compute_s": [6.0, 10.0]}, {"learners": ["us-0"], "compute_s": [4.0]}]
    outages = [Outage("us-0", 102.0, 110.0), Outage("eu-0", 102.0, 104.0), Outage("syncer", 103.0)]
    got = ledger.goodput(merges, fragments=2, members=["us-0", "eu-0", "eu-1"], outages=outages, step_time_s=0.5,
                         sync_every=10, now=999.0)
    assert ledger.first_beat == 100.0 and ledger.tails_s == {"us-0": 2.0}
    assert got == {
        "goodput": 10 / 24,                       # merged (6 + 4 + 10) / 2 fragments over 8 + 2 + 4 + 10 spent
        "goodput_wall": 10 / 50,                  # over 20 + 20 + 10 s in the run
        "goodput_per_learner": {"us-0": 5 / 14, "eu-0": 5 / 10, "eu-1": 0.0},
        "goodput_sync_equivalent": (20 - 8 - 3 * 2.5) / 20,  # the outages' union, 3 kills of half a sync each
        "kills": {"us-0": 1, "eu-0": 1, "syncer": 1},
    }
    ledger.takeovers = [{"previous": "0:m", "shard": 1, "fragment": 3, "time": 105.5},
                        {"previous": "1:m", "shard": 0, "fragment": 2, "time": 50.0}]  # shard 1 was never down
    assert ledger.takeover_times(["syncer-0", "syncer-1"], [Outage("syncer-0", 103.0, 104.0),
                                                            Outage("syncer-0", 105.0)]) == \
        [{"fragment": 3, "from": "syncer-0", "to": "syncer-1", "after_s": 0.5}]
