"""A run's start-up: what each learner does before it trains, as the live view shows it, the figures
bench/startup.py reads from the events, and a model entry imported once per run (in the fork server)."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
from rich.console import Console

from bench.startup import startup
from diloco.config import build_config
from diloco.progress import Progress, progress_line, progress_table
from diloco.spec import run_modules

CFG = build_config({"regions": [{"name": "us", "learners": 2}]})


def _ev(kind: str, t: float, learner: str = "us-0", incarnation: str = "a", **fields) -> dict:
    return {"kind": kind, "eid": f"{kind}-{learner}-{incarnation}-{t}-{fields.get('phase', '')}", "time": t,
            "learner": learner, "incarnation": incarnation, **fields}


def _table(prog: Progress, now: float) -> str:
    out = io.StringIO()
    Console(file=out, width=200).print(progress_table(CFG, prog, "r", 1.0, now=now))
    return out.getvalue()


def test_the_live_view_names_each_learners_phase_with_its_time():
    prog = Progress()
    prog.apply(_ev("learner_phase", 100.0, phase="importing"))
    prog.apply(_ev("learner_phase", 103.0, phase="compiling"))
    prog.apply(_ev("learner_phase", 101.0, learner="us-1", phase="importing"))
    assert prog.phase_of("us-0", 110.0) == "compiling 7s" and prog.phase_of("us-1", 110.0) == "importing 9s"
    table = _table(prog, 110.0)
    assert "compiling 7s" in table and "importing 9s" in table
    assert "1 importing (9s); 1 compiling (7s);" in progress_line(prog, 10.0, now=110.0)
    prog.apply(_ev("heartbeat", 112.0, step=1, state="running"))  # its first step: training from here
    assert prog.phase_of("us-0", 120.0) == "training 8s"
    assert "us-0 step 1" in progress_line(prog, 20.0, now=120.0) and "compiling" not in progress_line(prog, 20.0, now=120.0)
    prog.apply(_ev("heartbeat", 115.0, step=5, state="running"))
    assert prog.phase_of("us-0", 120.0) == "training 8s"  # the phase began at the first beat, not the last
    prog.apply(_ev("heartbeat", 119.0, step=40, state="finished"))
    assert prog.phase_of("us-0", 130.0) == "finished"


def test_a_restarted_learner_shows_its_new_phase_and_a_late_beat_of_the_killed_one_changes_nothing():
    prog = Progress()
    prog.apply(_ev("heartbeat", 100.0, step=10, state="running", incarnation="old"))
    prog.apply(_ev("learner_phase", 105.0, phase="importing", incarnation="new"))
    prog.apply(_ev("heartbeat", 104.0, step=11, state="running", incarnation="old"))  # sent before it died
    assert prog.phase_of("us-0", 106.0) == "importing 1s"
    assert "importing 1s" in _table(prog, 106.0)  # beside the old incarnation's last step
    prog.apply(_ev("heartbeat", 108.0, step=11, state="running", incarnation="new"))
    assert prog.phase_of("us-0", 110.0) == "training 2s"


def test_a_phase_event_of_the_wrong_shape_is_refused_and_a_learner_not_heard_from_is_starting():
    prog = Progress()
    for bad in (_ev("learner_phase", 1.0, phase="dancing"), _ev("learner_phase", 1.0, learner=7, phase="importing")):
        with pytest.raises(ValueError):
            prog.apply(bad)
    assert prog.phases == {} and prog.phase_of("us-0", 2.0) is None
    assert _table(prog, 2.0).count("starting") == 2


def test_startup_figures_are_read_from_the_events_times():
    events = [_ev("learner_phase", 105.0, phase="importing"), _ev("learner_phase", 107.0, phase="compiling"),
              _ev("heartbeat", 112.0, step=1), _ev("heartbeat", 113.0, step=2),
              {"kind": "syncer_started", "time": 103.0}, _ev("heartbeat", 115.5, learner="us-1", step=1)]
    got = startup(events, started=100.0)
    assert got["learners"] == {"us-0": {"importing": 5.0, "compiling": 7.0, "training": 12.0}, "us-1": {"training": 15.5}}
    assert got["all_training_s"] == 15.5 and got["syncer_started_s"] == 3.0
    assert startup(events[:2], started=100.0)["all_training_s"] is None  # us-0 never trained


def test_the_fork_server_imports_the_model_entrys_module_and_run_preload():
    cfg = build_config({"model": {"entry": "my_pkg.model:spec"}, "run": {"preload": ["transformers", "my_pkg.model"]}})
    assert run_modules(cfg) == ["my_pkg.model", "transformers"]
    assert run_modules(build_config({})) == ["diloco.models.transformer"]


@pytest.mark.integration
def test_a_model_entry_is_imported_once_per_run_not_once_per_learner(tiny_config, tmp_path, monkeypatch):
    """The entry module appends its process and command line to a file at import: the runner imports it
    (to provision the run), the fork server once, and none of the learners forked from it."""
    imports = tmp_path / "imports.txt"
    (tmp_path / "counted_model.py").write_text(
        "import os, sys\n"
        f"with open({str(imports)!r}, 'a') as f:\n"
        "    f.write(f'{os.getpid()} {\" \".join(sys.argv)}\\n')\n"
        "from diloco.models.transformer import spec\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    from diloco.run import train

    cfg = tiny_config(regions=[{"name": "us", "learners": 2}], model={"entry": "counted_model:spec"},
                      inner={"steps": 20}, fragments={"sync_every": 10})
    summary = train(cfg, progress=False, console=Console(quiet=True))
    assert summary["contributions"]["applied"] > 0
    lines = imports.read_text().splitlines()
    pids = [int(line.split()[0]) for line in lines]
    assert pids.count(os.getpid()) == 1, lines                  # the runner, provisioning the run
    others = [line for line in lines if int(line.split()[0]) != os.getpid()]
    assert len(others) == 1 and "forkserver" in others[0], lines  # once more, in the fork server: not per learner
    log = Path(summary["run_dir"]) / "logs" / "forkserver.log"
    assert "not preloaded" not in log.read_text()

