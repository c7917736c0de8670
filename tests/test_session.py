"""A learner's Session on the real broker, Redis and store: what it says at once to its own loop."""

from __future__ import annotations

import math
import socket
import time

import numpy as np
import pytest
from helpers import Harness

from diloco.infra.services import free_port
from diloco.learners.session import Session
from diloco.plan import flatten
from diloco.spec import load_spec

pytestmark = pytest.mark.integration


def test_a_session_refuses_zero_tokens_carries_a_nan_loss_as_none_and_frees_its_port(tiny_config):
    """Session.step(tokens=0) had every delta rejected with nothing said on the learner; a NaN loss
    made its heartbeats invalid (the learner looked silent, then dropped); close() left the port bound."""
    port = free_port()
    cfg = tiny_config(monitoring={"learner_port_base": port})
    h = Harness(cfg, f"session-{time.time_ns() % 10**6}", in_process=False)
    run_cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"id": h.run_id})})
    try:
        session = Session(run_cfg, "us-0", store=h.store)
        with session:
            params = session.join(load_spec(cfg).init(0))
            with pytest.raises(ValueError, match="tokens must be the positive number"):
                session.step(params, tokens=0)
            params = session.step(params, tokens=256, loss=float("nan"))
            assert session.loss is None and session.heartbeat.status["loss"] is None
            params = session.step(params, tokens=256, loss=2.5)
            assert math.isclose(session.loss, 2.5)
            with pytest.raises(OSError):
                socket.create_server(("127.0.0.1", port))     # its /metrics holds the port while it runs
        socket.create_server(("127.0.0.1", port)).close()     # and lets it go when closed
    finally:
        h.producer.close()


def test_a_learner_whose_template_is_version_0_reads_nothing_to_join(tiny_config):
    """Every learner read each fragment whole (fp32) to join, though its own init is version 0 bit for
    bit: that was a fifth of the demo's downloads. The digests stored with version 0 tell."""
    cfg = tiny_config()
    h = Harness(cfg, f"session-v0-{time.time_ns() % 10**6}", in_process=False)
    run_cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"id": h.run_id})})
    spec = load_spec(cfg)
    try:
        for seed, reads in ((cfg.model.seed, False), (123, True)):   # the run's init, then another one
            with Session(run_cfg, "us-0", store=h.store) as session:
                params = session.join(spec.init(seed))
                assert (session.counters.bytes_fetched > 0) is reads
                got = {n: np.asarray(a) for n, a in flatten(params, session.plan).items()}
                for n, a in got.items():                             # either way: version 0's values
                    np.testing.assert_array_equal(a, h.params[n].astype(a.dtype))
    finally:
        h.producer.close()


def test_a_learner_that_joins_a_run_under_way_starts_from_its_latest_version_not_its_init(tiny_config):
    """With the join by digest, a restarted learner took its own init for version 0 and trained from
    there: every delta it sent was stale. It waits for the newest version, caught up from its init."""
    cfg = tiny_config(syncer={"quorum": 2, "grace_max_s": 0.0})
    h = Harness(cfg, f"session-late-{time.time_ns() % 10**6}")
    run_cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"id": h.run_id})})
    try:
        h.rounds(1, fragment=0)
        assert h.state.versions()[0] == 1
        with Session(run_cfg, "us-0", store=h.store) as session:
            session.join(load_spec(cfg).init(cfg.model.seed))
            assert session.versions[0] == 1 and all(session.versions[p] == 0 for p in range(1, cfg.fragments.count))
    finally:
        h.producer.close()


@pytest.mark.parametrize("scheme", ["int8", "int2", "ternary", "topk"])
def test_what_a_delta_left_out_goes_with_the_next_one_and_the_learner_keeps_training_from_the_global(scheme):
    """outer_deltas, a learner's side of error feedback. For int8 the residual stays in the learner's
    values (base moves by what was sent); for int2 / ternary / topk, which leave out a third or more, it waits
    in the error buffer and base moves to the local values, so a rebase lands on the new global plus
    the steps since the send. Either way the deltas sent plus what is left add up to all progress."""
    import jax.numpy as jnp

    from diloco.learners.outer import Anchors, outer_deltas

    rng = np.random.default_rng(0)
    start = rng.normal(size=(8, 300)).astype(np.float32)
    base, local, error = Anchors("device"), jnp.asarray(start), {}
    base["w"] = jnp.asarray(start)
    sent = np.zeros_like(start)
    for _ in range(5):
        local = local - jnp.asarray(rng.normal(size=start.shape).astype(np.float32) * 0.01)  # inner steps
        sent += outer_deltas(base, {"w": local}, ["w"], {"w": scheme}, error)["w"].decoded()
        left = np.asarray(base["w"]) - np.asarray(local) + error.get("w", 0.0)       # what is still to send
        np.testing.assert_allclose(sent + left, start - np.asarray(local), atol=1e-4)
    if scheme == "int8":
        assert error == {} and np.abs(np.asarray(base["w"]) - np.asarray(local)).max() > 0
    else:
        np.testing.assert_array_equal(np.asarray(base["w"]), np.asarray(local))
        assert np.abs(error["w"]).max() > 0.01 * np.abs(sent).max()


def _sent_by_session(cfg, h) -> list:
    """(manifest, payload) of every contribution on region us's topic that the harness did not send."""
    from diloco import messages
    from diloco.infra import kafka as kafka_io

    h.producer.flush()
    topics = kafka_io.Topics.for_run(cfg, h.run_id)
    ours = messages.ChunkAssembler(max_bytes=1 << 30, timeout_s=60)
    sent = []
    for rec in kafka_io.read_to_end(cfg.transport, kafka_io.partitions_of(topics.fragments["us"], topics.partitions)):
        got = ours.add(*messages.parse_frame(rec.value), now=0.0)
        if isinstance(got, messages.Assembled) and got.manifest.id not in h.sent:
            sent.append((got.manifest, got.payload))
    return sent


def test_an_overwritten_fragment_claims_only_the_steps_trained_on_its_new_version(tiny_config):
    """With fragments.apply=overwrite a new global version throws away the steps since the fragment's
    last send, but they stayed counted: the next delta claimed their tokens, and a version applied at
    a learner's last step was handed in at close as an all-zero delta weighing those tokens (a
    conformance run caught one). The steps and tokens a delta claims are those it holds."""
    from diloco import messages

    cfg = tiny_config(syncer={"quorum": 2, "grace_max_s": 0.0})
    assert cfg.fragments.apply == "overwrite"
    h = Harness(cfg, f"session-overwrite-{time.time_ns() % 10**6}")
    run_cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"id": h.run_id})})
    last = cfg.fragments.count - 1                          # it syncs at step sync_every, after the others
    try:
        with Session(run_cfg, "us-0", store=h.store) as session:
            params = session.join(load_spec(cfg).init(cfg.model.seed))

            def nudged(params, by):
                import jax
                return jax.tree_util.tree_map(lambda a: a + by if a.dtype.kind == "f" else a, params)

            for _ in range(3):                              # steps the new version will throw away
                params = session.step(nudged(params, 0.01), tokens=100)
            h.rounds(1, fragment=last)
            deadline = time.time() + 30
            while session.versions[last] == 0:              # arrives while the learner trains
                assert time.time() < deadline and session.steps < cfg.fragments.sync_every - 2
                time.sleep(0.2)
                params = session.step(params, tokens=7)
            params = session.step(nudged(params, 0.05), tokens=100)   # the one step on version 1
        sent = [(m, messages.decode_payload(m, payload)) for m, payload in _sent_by_session(cfg, h)
                if m.fragment == last]
        assert [(m.base_version, m.tokens, m.steps) for m, _ in sent] == [(1, 100, 1)]
        for delta in sent[0][1].values():                   # global - local: the one step's -0.05
            np.testing.assert_allclose(delta, -0.05, atol=2e-3)
    finally:
        h.producer.close()


def test_a_delta_claims_the_compute_its_steps_took_not_the_wall_time_between_them(tiny_config):
    """A delta's step_time counted the wall time between Session.step calls, waits included, while the
    learner's compute_s counted compute only: merged work could exceed all work (goodput 1.096 was
    seen in a rebase run). Both now count the loop's compute_s, step by step."""
    cfg = tiny_config()
    h = Harness(cfg, f"session-compute-{time.time_ns() % 10**6}")
    run_cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"id": h.run_id})})
    try:
        with Session(run_cfg, "us-0", store=h.store) as session:
            params = session.join(load_spec(cfg).init(cfg.model.seed))
            for step in range(1, 7):
                time.sleep(0.05)                           # a wait (a fetch, a merge) outside compute
                params = session.step(params, tokens=100, compute_s=0.01 * step)
        sent = [m for m, _ in _sent_by_session(cfg, h)]
        assert len(sent) >= cfg.fragments.count                   # every fragment handed in at close
        for m in sent:
            assert m.step_time == pytest.approx(0.01), (m.fragment, m.steps, m.step_time)
        assert sum(m.steps * m.step_time for m in sent) == pytest.approx(cfg.fragments.count * 0.06)
    finally:
        h.producer.close()
