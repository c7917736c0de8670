"""Elastic membership of a live run: who is in it over time, and the operator's requests to a
local run (add learners to a region, ask one to leave).

Who may join is config (`regions[].max_learners`: ids `<region>-<k>` below it); the syncer admits a
learner on its first heartbeat and says so (`learner_admitted`), and a learner that is asked to stop
(SIGTERM) hands in its last deltas and says `left`, so no round waits for it (`learner_left`).

A local run (`diloco train`) owns its processes, so `diloco learners add/remove` does not start or
signal them itself: it drops a request into the run's `control/` folder, the runner carries it out
on its next tick and writes the answer beside it. Requests are small JSON files, answered once.
"""

from __future__ import annotations

import json
import os
import stat
import time
import uuid
from collections.abc import Iterable
from pathlib import Path

CONTROL = "control"
MAX_REQUEST_BYTES = 4096


class RequestError(RuntimeError):
    """A membership request that could not be carried out; the text says why."""


def submit(run_dir: Path, op: dict) -> Path:
    """Write a request for the runner of the run in `run_dir`; returns the path of its answer."""
    folder = Path(run_dir) / CONTROL
    folder.mkdir(parents=True, exist_ok=True)
    name = f"{time.time_ns()}-{uuid.uuid4().hex[:8]}"
    tmp = folder / f".{name}.tmp"
    tmp.write_text(json.dumps(op))
    os.replace(tmp, folder / f"{name}.json")  # whole or not at all for the runner's next look
    return folder / f"{name}.answer.json"


def wait(answer: Path, timeout_s: float = 60.0) -> dict:
    """The runner's answer to a request; RequestError if it says no or none came in time."""
    deadline = time.time() + timeout_s
    while not answer.exists():
        if time.time() > deadline:
            raise RequestError(f"no answer in {timeout_s:.0f}s: is the run's `diloco train` still running "
                               f"(it reads {answer.parent})?")
        time.sleep(0.1)
    result = json.loads(answer.read_text())
    if not result.get("ok"):
        raise RequestError(result.get("error", "refused"))
    return result


def pending(run_dir: Path) -> list[tuple[Path, dict | None]]:
    """Unanswered requests, oldest first: (path, request) with None for one that is not a JSON object."""
    folder = Path(run_dir) / CONTROL
    out = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        if path.name.endswith(".answer.json") or path.with_name(path.stem + ".answer.json").exists():
            continue
        try:
            info = path.lstat()
            if not stat.S_ISREG(info.st_mode):  # a FIFO, a device or a link would block or lead elsewhere
                op = None
            else:
                op = json.loads(path.read_bytes()[:MAX_REQUEST_BYTES]) if info.st_size <= MAX_REQUEST_BYTES else None
        except (OSError, ValueError, RecursionError):  # unreadable, not JSON, or nested deeper than json reads
            op = None
        out.append((path, op if isinstance(op, dict) else None))
    return out


def answer(request: Path, result: dict) -> None:
    path = request.with_name(request.stem + ".answer.json")
    tmp = path.with_name("." + path.name + ".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, path)


def free_ids(region, members: Iterable[str]) -> list[str]:
    """The ids a learner joining `region` (a RegionConfig) may take, lowest first: `<region>-<k>` below
    its capacity that are not in `members`."""
    taken = set(members)
    return [lid for lid in (f"{region.name}-{k}" for k in range(region.capacity)) if lid not in taken]


def timeline(initial: Iterable[str], events: Iterable[dict], *, start: float | None = None) -> list[dict]:
    """Membership over time from a run's events: one point per change, {time, members, change,
    learner}. A learner is a member from its admission (or the start) until it left, finished or was
    dropped; a silent one stays a member (it may come back)."""
    members = set(initial)
    points = [{"time": start, "members": len(members), "change": "start", "learner": None}]
    for ev in sorted((e for e in events if e.get("kind") in CHANGES), key=lambda e: e.get("time", 0.0)):
        lid, joins = ev.get("learner"), CHANGES[ev["kind"]]
        if joins == (lid in members):
            continue  # repeated (at-least-once events), or a finished learner's late beat
        (members.add if joins else members.discard)(lid)
        points.append({"time": ev.get("time"), "members": len(members), "change": ev["kind"], "learner": lid})
    return points


CHANGES = {"learner_admitted": True, "learner_joined": True,  # joined: also a left or dropped one coming back
            "learner_left": False, "learner_finished": False, "learner_dropped": False}
