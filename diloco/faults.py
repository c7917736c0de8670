"""Crash points for failure tests (in the spirit of etcd's gofail).

`DILOCO_CRASH_AT=<point>:<n>` makes the process SIGKILL itself the n-th time it passes `<point>`,
so a test can kill the syncer exactly between, say, the TensorStore write and the Redis commit.
Unset (always, outside tests), a crash point is one dictionary lookup.
"""

from __future__ import annotations

import os
import signal

_spec = os.environ.get("DILOCO_CRASH_AT", "")
_point, _, _count = _spec.partition(":")
_remaining = int(_count or 1) if _point else 0


def crash_point(name: str) -> None:
    global _remaining
    if _remaining and name == _point:
        _remaining -= 1
        if _remaining == 0:
            os.kill(os.getpid(), signal.SIGKILL)
