"""Warm starts (infra/forkserver.py): a forked job behaves as `python -m MODULE ARGV...` would."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from diloco.infra.forkserver import ForkServer
from diloco.infra.jobs import LocalJobs

HERE = Path(__file__).parent


def _env(**extra):
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
            "PYTHONUNBUFFERED": "1", **extra}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    forks = ForkServer(_env(FORKED_MARKER="from-the-server"), tmp_path_factory.mktemp("fork") / "forkserver.log")
    assert forks.ready(), (tmp_path_factory.getbasetemp() / "forkserver.log")
    yield forks
    forks.close()


def _spawn(server, tmp_path, *argv, stdin_text=None):
    log = tmp_path / "child.log"
    read, write = os.pipe()
    with open(log, "ab") as out:
        child = server.spawn(list(argv), read, out.fileno(), module="forked_child")
    os.close(read)
    if stdin_text is not None:
        os.write(write, stdin_text.encode())
    os.close(write)
    return child, log


def test_a_forked_job_sees_its_arguments_directory_input_and_the_servers_environment(server, tmp_path):
    child, log = _spawn(server, tmp_path, "report", "x", stdin_text="hello\n")
    assert child.wait(30) == 0
    seen = json.loads(log.read_text())
    assert seen["argv"] == ["report", "x"] and seen["cwd"] == os.getcwd() and seen["stdin"] == "hello"
    assert seen["marker"] == "from-the-server"
    assert seen["pid"] == child.pid != os.getpid()
    assert seen["sigterm_default"] and seen["sigint_raises"]  # not the server's dispositions
    assert seen["jax_loaded"]  # preloaded: the child did not import it


def test_a_forked_job_shows_its_own_command_line_to_ps(server, tmp_path):
    child, log = _spawn(server, tmp_path, "cmdline", "--learner", "us-0")
    assert child.wait(30) == 0
    assert log.read_text().strip() == f"{sys.executable} -m forked_child cmdline --learner us-0"


def test_exit_codes_and_signals_come_back_as_popen_reports_them(server, tmp_path):
    child, log = _spawn(server, tmp_path, "exit", "3")
    assert child.wait(30) == 3 and child.poll() == 3
    assert log.read_text() == "exiting\n"

    child, log = _spawn(server, tmp_path, "sleep")
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.2)
    assert child.poll() is None
    while "sleeping" not in log.read_text():
        pass
    child.send_signal(signal.SIGTERM)
    assert child.wait(30) == -signal.SIGTERM

    child, _ = _spawn(server, tmp_path, "sleep")
    child.kill()
    assert child.wait(30) == -signal.SIGKILL
    child.kill()  # a second kill of an ended job is a no-op, as with Popen


def test_a_forked_job_exits_as_a_process_does_running_its_atexit_handlers(server, tmp_path):
    child, log = _spawn(server, tmp_path, "atexit")
    assert child.wait(30) == 0
    assert log.read_text() == "atexit ran\n"


def test_jobs_outlive_nothing_when_the_server_dies(tmp_path):
    forks = ForkServer(_env(), tmp_path / "forkserver.log")
    assert forks.ready()
    child, _ = _spawn(forks, tmp_path, "sleep")
    forks.proc.kill()
    assert child.wait(30) == -signal.SIGKILL  # its exit code is lost with the server, so it is ended
    forks.close()
    deadline = time.monotonic() + 10
    while _alive(child.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child.pid)


def test_a_sigterm_to_the_process_group_leaves_the_server_to_the_runner_and_jobs_stop_cleanly(tmp_path):
    """Issue 53 M2: `timeout`, systemd or scancel signal the whole group; the server died at once and
    the runner then SIGKILLed every warm job in the middle of its clean stop (learners lost their last
    hand-in). The server now leaves SIGTERM to the runner, and each job gets it with its own handler."""
    forks = ForkServer(_env(), tmp_path / "forkserver.log")
    assert forks.ready()
    try:
        child, log = _spawn(forks, tmp_path, "graceful")
        deadline = time.monotonic() + 30
        while "sleeping" not in log.read_text():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        forks.proc.send_signal(signal.SIGTERM)           # what the group signal does to the server
        child.send_signal(signal.SIGTERM)                # ...and to the job
        assert child.wait(30) == 0 and "stopped cleanly" in log.read_text()
        assert forks.proc.poll() is None                 # still serving: the runner closes it
    finally:
        forks.close()


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_local_jobs_fork_jobs_in_the_runs_environment_and_start_the_others_from_scratch(tmp_path):
    jobs = LocalJobs(tmp_path / "logs", _env())
    try:
        warm = jobs.start("warm", ["--help"])
        cold = jobs.start("cold", ["--help"], env={"FORKED_MARKER": "own"})  # its own environment
        assert jobs.wait("warm", 60) == 0 and jobs.wait("cold", 60) == 0
        assert not isinstance(warm.popen, subprocess.Popen) and isinstance(cold.popen, subprocess.Popen)
        assert "Usage" in (tmp_path / "logs" / "warm.log").read_text()
        assert (tmp_path / "logs" / "warm.log").read_text() == (tmp_path / "logs" / "cold.log").read_text()
    finally:
        jobs.stop_all()
    assert jobs.forks is None


def test_jobs_start_from_scratch_once_the_server_is_gone(tmp_path, caplog):
    jobs = LocalJobs(tmp_path / "logs", _env())
    try:
        assert jobs.wait(jobs.start("first", ["--help"]).name, 60) == 0
        jobs.forks.proc.kill()
        jobs.forks.proc.wait()
        later = jobs.start("later", ["--help"])
        assert isinstance(later.popen, subprocess.Popen) and jobs.wait("later", 60) == 0
        assert "fork server failed" in caplog.text
    finally:
        jobs.stop_all()


def test_a_job_that_ends_at_once_has_its_pid_and_exit_code_read_from_one_message():
    """A job that exits before the runner reads its pid sends "<pid>\\n<code>\\n" in one packet: the
    runner took the whole of it for the pid (int() of two lines raised ValueError and ended the run)."""
    import socket

    from diloco.infra.forkserver import ForkedProcess, read_pid

    runner, server_end = socket.socketpair()
    try:
        server_end.sendall(b"4242\n3\n")
        pid, rest, pidfd = read_pid(runner)
        job = ForkedProcess(["x"], runner, pid, rest, pidfd)
        assert (job.pid, job.poll(), job.wait(timeout=0)) == (4242, 3, 3)
    finally:
        server_end.close()


def test_one_failed_fork_starts_that_job_from_scratch_and_keeps_the_warm_ones(tmp_path, monkeypatch):
    """One failed spawn (EAGAIN, ENOMEM, EMFILE in the server) closed the fork server, and every job
    it had forked lost its exit code and was SIGKILLed (reported -9)."""
    jobs = LocalJobs(tmp_path / "logs", _env())
    try:
        first = jobs.start("first", ["--help"])
        assert jobs.wait("first", 60) == 0 and not isinstance(first.popen, subprocess.Popen)
        fds = [os.open(os.devnull, os.O_RDONLY), os.open(os.devnull, os.O_WRONLY)]
        running = jobs.forks.spawn(["sleep"], *fds, module="forked_child")
        for fd in fds:
            os.close(fd)
        def refused(*_, **__):
            raise OSError("the fork server closed the connection before forking")
        monkeypatch.setattr(jobs.forks, "spawn", refused)
        later = jobs.start("later", ["--help"])
        assert isinstance(later.popen, subprocess.Popen) and jobs.wait("later", 60) == 0
        assert running.poll() is None and jobs.forks is not None   # the warm job runs on, its server too
        monkeypatch.undo()
        assert not isinstance(jobs.start("again", ["--help"]).popen, subprocess.Popen)  # the next one forks
        assert jobs.wait("again", 60) == 0
        running.kill()
        assert running.wait(30) == -signal.SIGKILL
    finally:
        jobs.stop_all()


def test_a_runner_that_hangs_up_during_a_spawn_leaves_the_server_serving_and_no_job_untracked(server, tmp_path):
    """The server's send of the pid to a runner that had gone raised BrokenPipeError and killed it, and
    the job just forked trained on with nobody to stop it or read its exit code: the server ends it.
    A runner that hangs up after the pid was sent, before it said it holds it, is the same case (on a
    loaded machine the server's send can come before the hang-up: CI caught one such job left running)."""
    import json as json_mod
    import socket

    from diloco.infra.forkserver import read_pid

    for pid_sent_first in (False, False, True, True):
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(server.path)
        request = {"module": "forked_child", "argv": ["sleep"], "cwd": str(tmp_path)}
        fds = [os.open(os.devnull, os.O_RDONLY), os.open(os.devnull, os.O_WRONLY)]
        socket.send_fds(conn, [json_mod.dumps(request).encode()], fds)
        if pid_sent_first:
            _, _, pidfd = read_pid(conn)
            if pidfd is not None:
                os.close(pidfd)
        conn.shutdown(socket.SHUT_RDWR)
        conn.close()
        for fd in fds:
            os.close(fd)
    child, log = _spawn(server, tmp_path, "exit", "4")
    assert child.wait(30) == 4 and server.proc.poll() is None
    deadline = time.monotonic() + 10
    while _jobs_in(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _jobs_in(tmp_path) == []


def _jobs_in(folder: Path) -> list[int]:
    """The live processes working in `folder`: the jobs forked for requests naming it as their cwd."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and os.readlink(entry / "cwd") == str(folder) and _alive(int(entry.name)):
                found.append(int(entry.name))
        except OSError:
            pass
    return found


def test_a_client_that_connects_and_sends_nothing_does_not_stall_the_server(tmp_path):
    """The single-threaded server waited on such a client's request for ever, and every spawn after it
    with it. A request must come within request_timeout_s of the connection; the client is dropped."""
    import socket
    import threading

    forks = ForkServer(_env(), tmp_path / "forkserver.log", request_timeout_s=0.5)
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        assert forks.ready()
        silent.connect(forks.path)
        spawned = []
        spawning = threading.Thread(target=lambda: spawned.append(_spawn(forks, tmp_path, "exit", "5")), daemon=True)
        spawning.start()
        spawning.join(30)
        assert spawned, "the spawn after a silent client got no pid"
        child, _ = spawned[0]
        assert child.wait(30) == 5 and forks.proc.poll() is None
        assert "TimeoutError" in (tmp_path / "forkserver.log").read_text()
    finally:
        silent.close()
        forks.close()


def test_a_job_is_signalled_through_its_pidfd_never_by_a_pid_that_may_be_reused(server, tmp_path):
    """When the server died, the runner SIGKILLed the job by number: had the job ended and been reaped
    by init meanwhile, that pid could name another process by then. The server sends a pidfd with the
    pid, and the runner signals through it. The test cannot make the kernel reuse a pid: it hands the
    runner the pid of a live bystander with the pidfd of a job that has ended and been reaped."""
    import socket

    from diloco.infra.forkserver import ForkedProcess, read_pid

    child, _ = _spawn(server, tmp_path, "sleep")
    assert child.pidfd is not None   # the server sent one
    child.kill()
    assert child.wait(30) == -signal.SIGKILL and child.pidfd is None

    ended = subprocess.Popen(["true"])
    pidfd = os.pidfd_open(ended.pid)
    ended.wait()                                  # reaped: its pid is free for another process
    bystander = subprocess.Popen(["sleep", "60"])  # stands in for the process that took it
    runner, server_end = socket.socketpair()
    try:
        socket.send_fds(server_end, [f"{bystander.pid}\n".encode()], [pidfd])
        os.close(pidfd)
        job = ForkedProcess(["x"], runner, *read_pid(runner))
        server_end.close()                        # the server died
        assert job.wait(5) == -signal.SIGKILL
        with pytest.raises(subprocess.TimeoutExpired):   # the bystander lives on
            bystander.wait(1)
    finally:
        bystander.kill()
        bystander.wait()


def _modules(tmp_path, **sources) -> dict:
    """Modules written to tmp_path (each appends its process id to <name>.imports when imported) and
    an environment that finds them."""
    for name, body in sources.items():
        (tmp_path / f"{name}.py").write_text(
            f"import os\nwith open({str(tmp_path / (name + '.imports'))!r}, 'a') as f:\n    f.write(f'{{os.getpid()}}\\n')\n{body}\n")
    return _env(PYTHONPATH=os.pathsep.join([str(tmp_path), str(HERE), os.environ.get("PYTHONPATH", "")]))


def _imports(tmp_path, name: str) -> list[int]:
    path = tmp_path / f"{name}.imports"
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def test_the_runs_modules_are_imported_once_in_the_server_and_a_failing_one_is_left_to_the_jobs(tmp_path):
    env = _modules(tmp_path, run_model_ok="", run_model_broken="raise RuntimeError('needs a GPU driver')")
    forks = ForkServer(env, tmp_path / "forkserver.log", preload=["run_model_ok", "run_model_broken"], ready_timeout_s=300)  # a loaded machine
    try:
        assert forks.ready(), (tmp_path / "forkserver.log").read_text()
        assert forks.not_preloaded == ["run_model_broken: RuntimeError: needs a GPU driver"]
        for job in ("a", "b"):
            (tmp_path / job).mkdir()
            child, log = _spawn(forks, tmp_path / job, "modules", "run_model_ok", "run_model_broken")
            assert child.wait(30) == 0
            assert json.loads(log.read_text()) == {"run_model_ok": True, "run_model_broken": False}
        assert _imports(tmp_path, "run_model_ok") == [forks.proc.pid]  # once, in the server: not per job
        assert "not preloaded: run_model_broken" in (tmp_path / "forkserver.log").read_text()
    finally:
        forks.close()


def test_a_run_module_that_starts_jaxs_backend_is_left_to_the_jobs_and_the_server_starts_again_without_it(tmp_path):
    env = _modules(tmp_path, run_model_jax="import jax.numpy as jnp\nZERO = jnp.zeros(1)", run_model_after="")
    forks = ForkServer(env, tmp_path / "forkserver.log", preload=["run_model_jax", "run_model_after"], ready_timeout_s=300)  # a loaded machine
    try:
        assert forks.ready(), (tmp_path / "forkserver.log").read_text()
        assert [line.split(":")[0] for line in forks.not_preloaded] == ["run_model_jax", "run_model_after"]
        assert "starts JAX's backend" in forks.not_preloaded[0]
        for job in ("a", "b"):
            (tmp_path / job).mkdir()
        child, log = _spawn(forks, tmp_path / "a", "modules", "run_model_jax", "run_model_after", "diloco.cli")
        assert child.wait(30) == 0
        assert json.loads(log.read_text()) == {"run_model_jax": False, "run_model_after": False, "diloco.cli": True}
        assert _imports(tmp_path, "run_model_jax") == [forks.proc.pid] and _imports(tmp_path, "run_model_after") == []
        child, log = _spawn(forks, tmp_path / "b", "report")  # the server that forks it never started a backend
        assert child.wait(30) == 0 and json.loads(log.read_text())["jax_loaded"]
    finally:
        forks.close()
