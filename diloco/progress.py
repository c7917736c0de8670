"""What a run's events topic has told its supervisor: each event checked (the topic is writable by
every learner), the learners' latest beats, versions, merges, rejections, and what they say was
handed in; and the live table drawn from it. All of it is advisory: where a restarted learner
resumes comes from the syncer's records (diloco.resume), never from here.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from rich.table import Table
from rich.text import Text

from diloco import membership, messages
from diloco.config import Config


REASON_CHARS = 64  # a rejection reason longer than this is no reason this code base gives
REMEMBERED_EIDS = 100_000  # ids of the newest events kept to drop a repeated delivery (minutes of a large run's)
PHASE_LEARNERS = 100_000  # learner names whose phase is kept: any learner may write the events topic


class RecentIds:
    """The newest `limit` event ids added, oldest first out: at-least-once delivery repeats recent
    events (a restarted syncer re-sends its unconfirmed outbox), and a bound keeps a writer of the
    events topic from growing the runner without end."""

    def __init__(self, limit: int = REMEMBERED_EIDS):
        self.limit = limit
        self._ids: dict[str, None] = {}  # insertion-ordered: the oldest first

    def __contains__(self, eid) -> bool:
        return isinstance(eid, str) and eid in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def add(self, eid: str) -> None:
        self._ids[eid] = None
        if len(self._ids) > self.limit:
            del self._ids[next(iter(self._ids))]


def check_event_fields(ev: dict) -> None:
    """ValueError unless the fields the runner reads have their types: a short string `eid`, a finite number
    `time` (if any), a short string rejection `reason`, integer fragments and versions of merges."""
    eid = ev.get("eid")
    if not messages.is_name(eid):
        raise ValueError(f"event id {messages.short(eid, 40)} is not a string of 1-{messages.MAX_NAME_CHARS} characters")
    t = ev.get("time", 0.0)
    if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t):
        raise ValueError(f"event time {messages.short(t, 40)} is not a number")
    kind = ev.get("kind")
    if kind == "contribution_rejected":
        reason = ev.get("reason")
        if not isinstance(reason, str) or not 0 < len(reason) <= REASON_CHARS:
            raise ValueError(f"rejection reason {messages.short(reason, 40)} is not a short string")
    elif kind == "learner_phase":
        if not messages.is_name(ev.get("learner")) or ev.get("phase") not in messages.LEARNER_PHASES:
            raise ValueError(f"phase {messages.short(ev.get('phase'), 40)} of learner {messages.short(ev.get('learner'), 40)}: "
                             f"not a learner's name and one of {messages.LEARNER_PHASES}")
    elif kind == "merge":
        if not all(messages.is_count(ev.get(k)) and ev[k] >= 0 for k in ("fragment", "version")) or not isinstance(ev.get("ids"), list):
            raise ValueError("merge event without integer fragment and version and a list of ids")


def check_heartbeat_claims(cfg: Config, ev: dict) -> None:
    """ValueError unless a (typed) heartbeat's step is within its learner's schedule (the live table and
    the chaos schedule follow it), what it says it handed in is no further than that step, and its
    tokens within what that many steps can hold at syncer.max_tokens_per_step."""
    lid, step, tokens = ev["learner"], ev.get("step", 0), ev.get("tokens", 0)
    if step > cfg.learner_steps(lid):
        raise ValueError(f"heartbeat of {lid} at step {step}: its schedule ends at {cfg.learner_steps(lid)}")
    if ev.get("handed_in_to", 0) > step:
        raise ValueError(f"heartbeat of {lid} at step {step} says it handed in steps up to {ev['handed_in_to']}")
    if ev.get("handed_in_tokens", 0) > tokens * cfg.fragments.count:  # each token is in one delta per fragment
        raise ValueError(f"heartbeat of {lid} says it handed in {ev['handed_in_tokens']} tokens of {tokens} trained "
                         f"over {cfg.fragments.count} fragments")
    if tokens > max(step, 1) * cfg.syncer.max_tokens_per_step:
        raise ValueError(f"heartbeat of {lid} claims {tokens} tokens in {step} steps (syncer.max_tokens_per_step="
                         f"{cfg.syncer.max_tokens_per_step})")


def check_accepted_cursor(cfg: Config, ev: dict) -> None:
    """ValueError unless an acceptance's cursor is [first, end] steps within its learner's schedule
    (what a restart waits, a bounded while, for the syncer's records to reach)."""
    lid, cur = ev.get("learner"), ev.get("cursor")
    if not isinstance(lid, str) or not cfg.is_member_id(lid):
        raise ValueError(f"acceptance of learner {messages.short(lid, 40)}, not one of this run's")
    if (not isinstance(cur, list) or len(cur) != 2 or not all(messages.is_count(x) for x in cur)
            or not 0 <= cur[0] <= cur[1] <= cfg.learner_steps(lid)):
        raise ValueError(f"acceptance of {lid} with cursor {messages.short(cur, 40)}: not [first, end] steps within "
                         f"its schedule of {cfg.learner_steps(lid)}")


@dataclass
class Progress:
    """What the events topic has told us so far."""
    learners: dict[str, dict] = field(default_factory=dict)
    versions: dict[int, int] = field(default_factory=dict)
    merges: int = 0
    accepted: int = 0
    rejected: int = 0
    rejections: dict[str, int] = field(default_factory=dict)
    merged_ids: list[str] = field(default_factory=list)
    kinds_seen: set[str] = field(default_factory=set)
    eids: RecentIds = field(default_factory=RecentIds)
    fetched: dict[tuple[str, str], int] = field(default_factory=dict)  # per (learner, incarnation)
    fetched_by_fragment: dict[tuple[str, str], dict[str, int]] = field(default_factory=dict)  # the same, per fragment
    merged: dict[tuple[int, int], int] = field(default_factory=dict)  # (fragment, version) -> tokens, as stored
    trained: dict[tuple[str, str], int] = field(default_factory=dict)  # tokens per (learner, incarnation)
    membership: list[dict] = field(default_factory=list)  # learner_admitted, _left, _finished, ... events
    # learner -> furthest cursor end the events say it handed in: a claim, that a restart only waits
    # (a bounded while) for the syncer's records to reach; it never moves a resume point
    handed_in: dict[str, int] = field(default_factory=dict)
    handed_in_tokens: dict[tuple[str, str], int] = field(default_factory=dict)  # per (learner, incarnation)
    # learner -> what it does now and since when: {"phase": importing|compiling|joining|training,
    # "since": event time, "incarnation"}; training from the first heartbeat of an incarnation
    phases: dict[str, dict] = field(default_factory=dict)

    def per_learner(self, counts: dict[tuple[str, str], int]) -> dict[str, int]:
        """A per-incarnation count summed per learner."""
        out: dict[str, int] = {}
        for (lid, _), n in counts.items():
            out[lid] = out.get(lid, 0) + n
        return out

    def tokens(self) -> int:
        """Tokens all learners trained: each incarnation counts from zero (a restarted learner resumes at
        the syncer's furthest record of it), so the latest beat of every incarnation is summed."""
        return sum(self.trained.values())

    def merged_tokens(self, fragments: int) -> int:
        """Tokens in the global model: the merges' tokens as the syncer stored them with each version
        (`merged`, filled by the runner once it checked a merge event against the store), over the
        fragments (every token trains each fragment once)."""
        return sum(self.merged.values()) // max(fragments, 1)

    def apply(self, ev: dict) -> None:
        """Take one event in; raises ValueError (the caller skips the event) on a field of the wrong
        type: the events topic is writable by every learner."""
        if ev.get("eid") in self.eids:  # at-least-once delivery: a restarted syncer may repeat events
            return
        check_event_fields(ev)
        self.eids.add(ev["eid"])
        if ev["kind"] == "heartbeat":  # a restarted learner counts from zero: keep every incarnation's
            key = (ev["learner"], ev.get("incarnation", ""))
            self.fetched[key] = max(self.fetched.get(key, 0), ev.get("bytes_fetched", 0))
            parts = self.fetched_by_fragment.setdefault(key, {})
            for p, n in (ev.get("fetched_by_fragment") or {}).items():
                parts[p] = max(parts.get(p, 0), n)
            self.trained[key] = max(self.trained.get(key, 0), ev.get("tokens", 0))
            self.handed_in[ev["learner"]] = max(self.handed_in.get(ev["learner"], 0), ev.get("handed_in_to", 0))
            self.handed_in_tokens[key] = max(self.handed_in_tokens.get(key, 0), ev.get("handed_in_tokens", 0))
        if ev["kind"] in ("heartbeat", "learner_phase"):
            self._phase(ev)
        if ev["kind"] == "heartbeat" and ev.get("step", 0) < self.learners.get(ev["learner"], {}).get("step", 0):
            return  # a late beat of a killed incarnation: the restarted one resumed further on
        kind = ev["kind"]
        self.kinds_seen.add(kind)
        if kind == "heartbeat":
            self.learners[ev["learner"]] = ev
        elif kind == "merge":
            self.merges += 1
            self.versions[int(ev["fragment"])] = int(ev["version"])
            self.merged_ids.extend(ev["ids"])
        elif kind == "contribution_accepted":
            self.accepted += 1
            if ev.get("cursor") is not None:  # checked by the caller: the syncer took it, so it was handed in
                self.handed_in[ev["learner"]] = max(self.handed_in.get(ev["learner"], 0), ev["cursor"][1])
        elif kind == "contribution_rejected":
            self.rejected += 1
            self.rejections[ev["reason"]] = self.rejections.get(ev["reason"], 0) + 1
        elif kind == "syncer_started":
            self.versions |= {int(k): int(v) for k, v in ev["versions"].items()}
        elif kind in membership.CHANGES:
            self.membership.append(ev)


    def _phase(self, ev: dict) -> None:
        """A learner's phase event, or its heartbeat (training from the first of an incarnation). A beat
        of an incarnation older than the phase shown (a killed one's, late) changes nothing."""
        lid, inc = ev["learner"], ev.get("incarnation", "")
        now = self.phases.get(lid)
        if now is None and len(self.phases) >= PHASE_LEARNERS:
            raise ValueError(f"phases of {PHASE_LEARNERS} learners kept already")
        phase, t = ev["phase"] if ev["kind"] == "learner_phase" else "training", ev.get("time", 0.0)
        if now is None or (now["incarnation"] == inc and now["phase"] != phase) or (
                now["incarnation"] != inc and t >= now["since"]):
            self.phases[lid] = {"phase": phase, "since": t, "incarnation": inc}

    def phase_of(self, lid: str, now: float) -> str | None:
        """What the learner does now, with its time (`compiling 4s`), or None before it said anything.
        A learner whose last heartbeat said it finished or left says that."""
        ph, hb = self.phases.get(lid), self.learners.get(lid, {})
        if hb.get("state") in ("finished", "left") and (ph is None or ph["incarnation"] == hb.get("incarnation", "")):
            return hb["state"]
        return None if ph is None else f"{ph['phase']} {max(now - ph['since'], 0):.0f}s"


def progress_table(cfg: Config, prog: Progress, run_id: str, elapsed: float, now: float | None = None) -> Table:
    """The live table: a row per learner, its state the phase it is in with its time (importing,
    compiling, joining, training; `starting` before it said anything), or finished or left."""
    now = time.time() if now is None else now
    t = Table(title=f"run {run_id}  ({elapsed:.0f}s)", title_justify="left")
    for col in ("learner", "step", "tokens", "loss", "step ms", "sent", "state"):
        t.add_column(col, justify="right" if col not in ("learner", "state") else "left")
    for lid in sorted(set(cfg.learner_ids()) | set(prog.learners), key=cfg.shard_index):
        hb, state = prog.learners.get(lid), prog.phase_of(lid, now) or "starting"
        if hb is None:
            t.add_row(Text(lid), "-", "-", "-", "-", "-", Text(state))
            continue
        t.add_row(*(Text(str(x)) for x in (
            lid, f"{hb.get('step', 0)}/{cfg.learner_steps(lid)}", f"{hb.get('tokens', 0):,}", _loss(hb),
            f"{1000 * hb.get('step_time', 0.0):.0f}", f"{hb.get('published', 0)} ({hb.get('bytes_sent', 0) / 1e6:.2f} MB)",
            state)))
    versions = " ".join(f"p{p}:v{v}" for p, v in sorted(prog.versions.items()))
    rej = ", ".join(f"{k} {v}" for k, v in sorted(prog.rejections.items())) or "none"
    t.caption = Text(f"syncer: {versions} | merges {prog.merges} | accepted {prog.accepted} | rejected {prog.rejected} ({rej})")
    return t


def _loss(hb: dict) -> str:
    return "-" if hb.get("loss") is None else f"{hb['loss']:.3f}"


def progress_line(prog: Progress, elapsed: float, now: float | None = None) -> str:
    """The live table in a line (without a terminal): each learner's step and loss, and how many of
    those yet to train are in each phase, with the longest time one has spent in it."""
    now = time.time() if now is None else now
    parts = [f"{k} step {v.get('step', 0)} loss {_loss(v)};" for k, v in sorted(prog.learners.items())]
    waiting: dict[str, list[float]] = {}  # phase -> seconds each learner yet to train has spent in it
    for lid, ph in prog.phases.items():
        if lid not in prog.learners:
            waiting.setdefault(ph["phase"], []).append(now - ph["since"])
    parts += [f"{len(waiting[p])} {p} ({max(waiting[p]):.0f}s);" for p in messages.LEARNER_PHASES if p in waiting]
    lrn = " ".join(parts)
    vers = " ".join(f"p{p}:v{v}" for p, v in sorted(prog.versions.items()))
    return (f"[{elapsed:4.0f}s] {lrn or 'learners starting;'} syncer {vers} merges {prog.merges} "
            f"accepted {prog.accepted} rejected {prog.rejected}")
