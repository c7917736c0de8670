"""A fragment's exact state at any committed version: its snapshot, then each merge since replayed
from the contributions it merged (read back from Kafka where its merge record says they are), each
checked bit for bit against the update stored for that version."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from diloco import messages, signing
from diloco.config import Config
from diloco.infra import kafka as kafka_io
from diloco.infra.kafka import LogError
from diloco.infra.store import FragmentStore, StoreError
from diloco.messages import Assembled, ChunkAssembler, FrameHeader, Manifest, WireError
from diloco.plan import Plan
from diloco.syncer import fused
from diloco.syncer import merge as merge_math
from diloco.syncer.intake import Intake
from diloco.syncer.records import TP, Contribution, Where, partition_key
from diloco.syncer.rounds import FragmentState, Pending, close_round


log = logging.getLogger(__name__)


class RebuildError(RuntimeError):
    """A version between snapshots cannot be replayed exactly."""


def read_back(cfg: Config, run_id: str, wanted: dict[str, tuple[str, int, int]], timeout_s: float = 60.0
              ) -> dict[str, tuple[Manifest, bytes]]:
    """The contributions `wanted` (id -> topic, partition, offset of its first record), read back
    from the log and reassembled from that place only (a set of the id anywhere else, or starting at
    another offset, is another writer's); those the log no longer holds are left out."""
    by_tp: dict[TP, int] = {}
    for topic, partition, offset in wanted.values():
        by_tp[(topic, partition)] = min(by_tp.get((topic, partition), offset), offset)
    out: dict[str, tuple[Manifest, bytes]] = {}
    if not by_tp:
        return out
    assembler = ChunkAssembler(max_bytes=cfg.syncer.max_contribution_bytes, timeout_s=timeout_s)
    secret = cfg.signing_secret()   # a signed run: a frame counts only signed, and by its set's signer
    keys = {lid: signing.learner_key(secret, run_id, lid) for lid in cfg.member_ids()} if secret else {}
    c = kafka_io.consumer(cfg.transport)
    try:
        c.assign(by_tp)
        deadline = time.time() + timeout_s
        while len(out) < len(wanted) and time.time() < deadline:
            for records in c.poll(timeout_ms=200).values():
                for rec in records:
                    where = partition_key((rec.topic, rec.partition))
                    try:
                        signer = signing.signer_of(rec.headers, rec.value, keys.get) if secret else None
                        header, payload = messages.parse_frame(rec.value)
                    except (WireError, signing.SigningError):
                        continue
                    typed = FrameHeader.from_header(header)
                    cid = typed.id
                    if cid not in wanted or cid in out or not _at(wanted[cid], rec.topic, rec.partition, rec.offset):
                        continue
                    if signer is not None and Intake.not_the_signers(typed, signer, assembler.signer(cid, where)):
                        continue  # the intake's rule: a frame of another learner never joins the set
                    got = assembler.add(header, payload, now=time.time(), offset=rec.offset, where=where, signer=signer)
                    if isinstance(got, Assembled) and got.manifest.run == run_id and got.first_offset == wanted[cid][2]:
                        out[cid] = (got.manifest, got.payload)
            if all(c.highwater(tp) is not None and c.position(tp) >= c.highwater(tp) for tp in by_tp):
                break
    finally:
        c.close()
    return out


def _at(place: tuple[str, int, int], topic: str, partition: int, offset: int) -> bool:
    """Whether a record at (topic, partition, offset) may belong to the contribution first recorded at `place`."""
    return (topic, partition) == place[:2] and offset >= place[2]


def snapshot_state(store: FragmentStore, plan: Plan, opt, p: int, v: int) -> FragmentState:
    """Fragment p as stored whole at version v (a snapshot): parameters, outer state, residual."""
    fv = store.read(p, v)
    template = opt.init(merge_math.as_float32({n: fv.params[n] for n in plan.fragment_names[p]}))
    return FragmentState(v, fv.params, merge_math.unflatten_state(template, fv.opt), residual=fv.residual,
                         snapshot_at=v, snapshot=fv.params)


def rebuild(cfg: Config, run_id: str, plan: Plan, opt, store: FragmentStore, merges: list[dict], p: int, v: int,
            *, read=read_back) -> tuple[FragmentState, str | None]:
    """(fragment p's state at version v, None), or, if a contribution cannot be read back (retention)
    or a replay does not reproduce its stored update, (its exact parameters with the snapshot's outer
    state and no residual, why). `merges` are the run's merge records."""
    chain = store.chain(p, v)
    s, metas = chain.snapshot, {link.version: link.meta for link in chain.links}
    st = snapshot_state(store, plan, opt, p, s)
    if cfg.syncer.updates_from == "previous":  # each update from the version before: no base kept
        st.snapshot = None
    snapshot = st.snapshot
    if s == v:
        return st, None
    records = {m["version"]: m for m in merges if m["fragment"] == p and s < m["version"] <= v}
    try:
        if sorted(records) != list(range(s + 1, v + 1)):
            raise RebuildError(f"merge records of versions {sorted(set(range(s + 1, v + 1)) - set(records))} missing")
        wanted = {cid: tuple(w) for u in records.values() for cid, w in zip(u["ids"], u["where"])}
        found = read(cfg, run_id, wanted)
        for u in range(s + 1, v + 1):
            rec = records[u]
            contribs = []
            for cid in rec["ids"]:
                if cid not in found:
                    raise RebuildError(f"contribution {cid} of v{u} is no longer in the log")
                m, payload = found[cid]
                contribs.append(Pending(Contribution.accepted(m, Where(*wanted[cid]), arrival=0.0),
                                        fused.encoded_delta(m, payload)))
            closed = close_round(cfg, plan, st, p, contribs, rec["share"])
            if closed.update != store.read_update(p, u, metas.get(u))[1]:
                raise RebuildError(f"replaying v{u} does not reproduce its stored update")
            st.version, st.params, st.opt_state, st.residual = u, closed.params, closed.opt_state, closed.residual
        return st, None
    except (RebuildError, StoreError, WireError, LogError, KeyError, ValueError) as err:
        params, _ = store.read_params(p, v, metas.get(v))
        return FragmentState(v, params, st.opt_state, residual={}, snapshot_at=s, snapshot=snapshot), str(err)


def load(cfg: Config, run_id: str, plan: Plan, opt, store: FragmentStore, merges: list[dict], p: int, v: int,
         *, emit: Callable[..., None]) -> FragmentState:
    """Fragment p's state at version v for its new owner (`rebuild`); an approximate one (exact
    parameters, the snapshot's outer state) is said loudly, in the log and a `fragment_state_approximate`
    event (`emit`)."""
    st, approximate = rebuild(cfg, run_id, plan, opt, store, merges, p, v)
    st.tokens_merged = sum(r["tokens"] for r in merges if r["fragment"] == p and r["version"] <= v)
    if approximate is None:
        if st.snapshot_at != v:
            log.info("fragment rebuilt from its snapshot", extra={"fragment": p, "snapshot": st.snapshot_at,
                                                                  "version": v})
        return st
    log.error("fragment %d: outer state not rebuilt exactly since snapshot v%d (%s); parameters are exact, "
              "momentum and residual restart from the snapshot", p, st.snapshot_at, approximate)
    emit("fragment_state_approximate", fragment=p, snapshot=st.snapshot_at, version=v,
         reason=messages.bounded(approximate, messages.DETAIL_CHARS))
    return st
