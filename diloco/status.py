"""A run's live status: who is training, where each fragment stands, the last rounds, rejections.

`build` is one pure function from what Redis holds (`snapshot`) and the recent events to a plain
dict; `diloco status` renders it as terminal tables (`tables`), the syncer as a web page (`html`,
beside /metrics) and as /status.json.
"""

from __future__ import annotations

import html as html_mod
import json
import math
import time

from rich.table import Table
from rich.text import Text

from diloco.config import Config
from diloco.syncer.records import rejections_by_reason
from diloco.syncer.state import SyncerState

ROUNDS = 10       # last merges shown
REJECTIONS = 10   # last rejection events shown


def snapshot(state: SyncerState, fragments: int) -> dict:
    """What the status needs from Redis, read once."""
    return {"registry": state.registry(), "members": state.members(), "versions": state.versions(),
            "counters": state.counters(), "merges": state.merges(last=ROUNDS),
            "pending": state.pending_counts(fragments), "leases": state.lease_holders(fragments),
            "outbox": state.outbox_depth()}


def _age(now: float, then) -> float | None:
    """Seconds since `then`, or None when `then` is not a finite number (an event from outside)."""
    if isinstance(then, bool) or not isinstance(then, (int, float)) or not math.isfinite(then):
        return None
    return round(now - then, 1)


def build(cfg: Config, run_id: str, snap: dict, events: list[dict], now: float) -> dict:
    """The status of run `run_id` at time `now` from a `snapshot` and recent events (oldest first)."""
    members = []
    for lid in sorted(set(cfg.learner_ids()) | set(snap["members"]) | set(snap["registry"]), key=_member_order(cfg)):
        hb = snap["registry"].get(lid)
        if hb is None:
            members.append({"id": lid, "state": "no heartbeat", "heartbeat_age_s": None, "step": None,
                            "tokens": None, "loss": None, "region": lid.rsplit("-", 1)[0]})
            continue
        age = _age(now, hb.get("seen", now))
        state = hb.get("status", "alive")
        if state == "alive" and age is not None and age > cfg.syncer.silent_after_s:
            state = "silent"
        members.append({"id": lid, "state": state, "heartbeat_age_s": age, "step": hb.get("step"),
                        "tokens": hb.get("tokens"), "loss": hb.get("loss"), "region": hb.get("region")})
    fragments = [{"fragment": p, "version": v, "pending": snap["pending"].get(p, 0),
                  "owner": (snap["leases"].get(p) or "-").split(":")[0]} for p, v in sorted(snap["versions"].items())]
    rounds = [{"fragment": m["fragment"], "version": m["version"], "contributors": m["learners"],
               "missing": m.get("missing", []), "late": m.get("late", 0), "reason": m.get("reason"),
               "waited_s": m.get("waited_s"), "tokens": m.get("tokens"), "age_s": _age(now, m.get("time"))}
              for m in reversed(snap["merges"])]
    c = snap["counters"]
    recent = [{"id": e.get("id"), "reason": e.get("reason"), "learner": e.get("learner"),
               "fragment": e.get("fragment"), "detail": e.get("detail"), "age_s": _age(now, e.get("time"))}
              for e in events if e.get("kind") == "contribution_rejected"][-REJECTIONS:][::-1]
    return {"run": run_id, "time": now, "members": members, "fragments": fragments, "rounds": rounds,
            "counters": {k: c.get(k, 0) for k in ("accepted", "applied", "rejected", "merges", "late")}
            | {"outbox": snap["outbox"]},
            "rejections": {"by_reason": dict(sorted(rejections_by_reason(c).items())),
                           "recent": recent}}


def _member_order(cfg: Config):
    ids = cfg.member_ids()
    return lambda lid: (ids.index(lid) if lid in ids else len(ids), lid)


# --- rendering ----------------------------------------------------------------------------------
def _rows(status: dict) -> dict[str, tuple[list[str], list[list[str]]]]:
    """Each section as (header, rows of text): what both renderings show."""
    def num(x, fmt="{:,}"):
        return "-" if x is None else fmt.format(x)
    c = status["counters"]
    return {
        "members": (["learner", "region", "state", "heartbeat age s", "step", "tokens", "loss"],
                    [[m["id"], m["region"] or "-", m["state"], num(m["heartbeat_age_s"], "{:.1f}"), num(m["step"]),
                      num(m["tokens"]), num(m["loss"], "{:.4f}")] for m in status["members"]]),
        "fragments": (["fragment", "version", "pending", "owner shard"],
                      [[str(f["fragment"]), str(f["version"]), str(f["pending"]), f["owner"]]
                       for f in status["fragments"]]),
        "rounds": (["fragment", "version", "contributors", "missing", "late", "reason", "grace wait s", "age s"],
                   [[str(r["fragment"]), str(r["version"]), " ".join(r["contributors"]), " ".join(r["missing"]) or "-",
                     str(r["late"]), str(r["reason"]), num(r["waited_s"], "{:.2f}"), num(r["age_s"], "{:.1f}")]
                    for r in status["rounds"]]),
        "rejections": (["reason", "count"], [[k, str(v)] for k, v in status["rejections"]["by_reason"].items()]),
        "recent rejections": (["id", "reason", "learner", "fragment", "detail", "age s"],
                              [[str(r["id"]), str(r["reason"]), str(r["learner"]), str(r["fragment"]),
                                str(r["detail"])[:120], num(r["age_s"], "{:.1f}")]
                               for r in status["rejections"]["recent"]]),
        "totals": (["accepted", "applied", "rejected", "merges", "late", "outbox"],
                   [[str(c[k]) for k in ("accepted", "applied", "rejected", "merges", "late", "outbox")]]),
    }


def tables(status: dict) -> list[Table]:
    """The status as rich tables, one per section."""
    out = []
    for title, (header, rows) in _rows(status).items():
        t = Table(title=f"{title}" if title != "members" else f"run {status['run']}: members", title_justify="left")
        for h in header:
            t.add_column(h)
        for row in rows:
            t.add_row(*(Text(str(cell)) for cell in row))  # ids and details come from outside: never markup
        out.append(t)
    return out


_STYLE = ("body{font-family:sans-serif;margin:1.5em;color:#222}table{border-collapse:collapse;margin-bottom:1.5em}"
          "th,td{border:1px solid #bbb;padding:.25em .6em;text-align:left}th{background:#e8eef7}"
          "h2{font-size:1.1em;margin-bottom:.3em}")


def html(status: dict, refresh_s: int = 2) -> str:
    """The status as one self-refreshing HTML page."""
    e = html_mod.escape
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><meta http-equiv='refresh' content='{refresh_s}'>",
             f"<title>diloco {e(status['run'])}</title><style>{_STYLE}</style></head><body>",
             f"<h1>run {e(status['run'])}</h1><p>as of {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(status['time']))}"
             " &middot; <a href='/metrics'>metrics</a> &middot; <a href='/status.json'>json</a></p>"]
    for title, (header, rows) in _rows(status).items():
        parts.append(f"<h2>{e(title)}</h2><table id='{e(title.replace(' ', '-'))}'><tr>"
                     + "".join(f"<th>{e(h)}</th>" for h in header) + "</tr>")
        parts += ["<tr>" + "".join(f"<td>{e(x)}</td>" for x in row) + "</tr>" for row in rows]
        parts.append("</table>")
    return "".join(parts) + "</body></html>"


def to_json(status: dict) -> str:
    return json.dumps(status, indent=1)
