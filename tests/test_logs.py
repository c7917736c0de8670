"""Third-party warnings that ask nothing of the user stay off the console; everything else still shows."""

from __future__ import annotations

import logging
import subprocess
import sys


def test_importing_the_pipelines_prints_no_apitools_warning_and_other_root_warnings_still_show():
    probe = ("import logging; logging.basicConfig(); import diloco.pipelines.corpus; "
             "logging.warning('apitools not found, said again'); logging.warning('a warning of ours')")
    err = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stderr
    assert "apitools" not in err and "a warning of ours" in err, err


def test_kafkas_slow_task_warning_is_dropped_and_its_other_warnings_are_not(caplog):
    from diloco.infra import kafka  # noqa: F401  (installs the filter)

    selector = logging.getLogger("kafka.net.selector")
    with caplog.at_level(logging.WARNING, logger="kafka.net.selector"):
        selector.warning("Task %r ran for %.3fs (>%.3fs threshold). It is blocking the event loop -- likely a "
                         "tight sync loop inside a coroutine. Other pollers will time out." % ("t", 0.2, 0.1))
        selector.warning("Task %s left RUNNING after step; demoting to UNSCHEDULED", "t")
    assert [r.getMessage() for r in caplog.records] == ["Task t left RUNNING after step; demoting to UNSCHEDULED"]
