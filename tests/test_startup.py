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


def test_an_unimportable_entry_says_where_it_looked_and_suggests_pythonpath(tmp_path, monkeypatch):
    from diloco.config import ConfigError
    from diloco.spec import load_entry

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as err:
        load_entry("my_model_nowhere.model:spec")
    text = str(err.value)
    assert "no module 'my_model_nowhere'" in text and "PYTHONPATH=" in text and str(tmp_path) in text
    (tmp_path / "needs_a_library.py").write_text("import some_library_not_installed\n")
    with pytest.raises(ConfigError, match="No module named 'some_library_not_installed' \\(install "
                                          "'some_library_not_installed' in this environment"):
        load_entry("needs_a_library:spec")


def test_services_not_started_by_this_users_infra_up_are_named_on_the_embedded_defaults(tmp_path):
    import socket

    from diloco.infra.services import listener_uid, not_ours
    from diloco.run import foreign_stack

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert listener_uid(port) == os.getuid()
        assert "kafka.pid names no live process" in not_ours("kafka", port, tmp_path)
        (tmp_path / "kafka.pid").write_text(str(os.getpid()))
        assert not_ours("kafka", port, tmp_path) is None                       # ours, started here
        assert f"belongs to uid {os.getuid()}, not to you" in not_ours("kafka", port, tmp_path, uid=os.getuid() + 1)
    notice = foreign_stack(build_config({}), tmp_path / "elsewhere")
    assert "kafka on 127.0.0.1:9092" in notice and "redis on 127.0.0.1:6379" in notice and "--config FILE" in notice
    own = {"transport": {"bootstrap_servers": "127.0.0.1:19092"}, "state": {"redis_url": "redis://127.0.0.1:16379/0"}}
    assert foreign_stack(build_config(own), tmp_path / "elsewhere") is None    # a stack of one's own: nothing to say


@pytest.mark.integration
def test_a_start_that_fails_leaves_no_run_folder(tiny_config, tmp_path):
    from diloco.config import ConfigError
    from diloco.run import train

    cfg = tiny_config(model={"entry": "no_model_here_xyz:spec"})
    with pytest.raises(ConfigError, match="PYTHONPATH"):
        train(cfg, progress=False, console=Console(quiet=True))
    assert not Path(cfg.run.dir).exists() or list(Path(cfg.run.dir).iterdir()) == []


def test_a_name_or_path_a_user_wrote_is_printed_as_written_not_read_as_markup(tmp_path):
    from typer.testing import CliRunner

    from diloco.cli import app

    config = tmp_path / "[red]runs[/]" / "config.yaml"
    res = CliRunner().invoke(app, ["learners", "remove", "--config", str(config), "[/]"])
    assert res.exit_code == 2, res.output
    flat = "".join(res.output.split())  # as written, however the console wrapped it
    assert "".join(f"error: {config} is not a run's config.yaml".split()) in flat, res.output


def test_an_unreachable_broker_names_its_address_and_infra_up_with_the_config():
    from diloco.config import TransportConfig
    from diloco.infra import kafka as kafka_io
    from diloco.infra.services import free_port

    port = free_port()  # nothing listens there
    with pytest.raises(kafka_io.TransportError) as err:
        kafka_io.ensure_topics(TransportConfig(bootstrap_servers=f"127.0.0.1:{port}"), {}, timeout_s=1)
    assert f"127.0.0.1:{port}" in str(err.value) and "diloco infra up --config" in str(err.value)


def test_the_byte_corpus_separator_is_configurable_for_models_that_read_0_as_padding(tmp_path):
    """data.separator: the byte corpus joins documents with 0 unless told otherwise; 256 widens its
    vocabulary to 257, and a document keeps every byte (a NUL inside one is dropped, as before)."""
    pytest.importorskip("apache_beam")
    import numpy as np

    from diloco.pipelines.prepared import ensure_corpus

    src = tmp_path / "src"
    src.mkdir()
    texts = [f"document {i} " * 20 for i in range(12)]
    for i, t in enumerate(texts):
        (src / f"doc{i:02d}.txt").write_text(t)
    corpus = ensure_corpus(str(src), str(tmp_path / "data"), learners=1, heldout_fraction=0.2, max_bytes=1 << 20,
                           seed=0, separator=256)
    m = corpus.manifest
    assert (m["separator"], m["vocab_size"], m["dtype"]) == (256, 257, "uint16")
    tokens = np.concatenate([corpus.train_tokens(0), corpus.heldout_tokens()])
    assert 0 not in tokens and (tokens == 256).sum() == len(texts) - 2  # one between each two in a part
    assert (tokens != 256).sum() == sum(len(t.encode()) for t in texts)
    default = ensure_corpus(str(src), str(tmp_path / "data"), learners=1, heldout_fraction=0.2, max_bytes=1 << 20, seed=0)
    assert default.dir != corpus.dir and default.manifest["separator"] == 0  # another corpus: another key
