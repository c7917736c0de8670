"""Structured logs: one JSON object per line, with the component and any `extra=` fields."""

from __future__ import annotations

import json
import logging
import sys
import time

_RESERVED = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def __init__(self, component: str):
        super().__init__()
        self.component = component

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(time.time(), 3), "level": record.levelname.lower(), "component": self.component,
               "logger": record.name, "msg": record.getMessage()}
        out |= {k: v for k, v in vars(record).items() if k not in _RESERVED and not k.startswith("_")}
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup(component: str, level: int = logging.INFO, stream=None) -> None:
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter(component))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("kafka", "jax", "absl"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


class _Drop(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in str(record.msg)


def quiet(logger: str, text: str) -> None:
    """Drop the records of `logger` whose message holds `text`: a third-party warning that asks nothing
    of the user (the logger's other records still pass)."""
    logging.getLogger(logger).addFilter(_Drop(text))
