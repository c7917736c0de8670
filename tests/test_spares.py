"""Warm spare learners (run.spares): the built-in AdamW compiles once for every start step, the
spare's assignment is checked, and in a chaos run a spare takes a killed learner's place within seconds."""

from __future__ import annotations

import io
import json
from collections import Counter
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_exact_accounting, run_events
from rich.console import Console

from diloco import chaos
from diloco.config import ConfigError, build_config
from diloco.infra.jobs import LocalJobs
from diloco.learners import learner, spare
from diloco.models.transformer import adamw
from diloco.run import child_env, finish, open_run, prepare


def _old_adamw(cfg, start_step, steps):
    """The built-in AdamW as it was, with the start step baked into the schedule: the reference."""
    warmup = max(cfg.inner.warmup_steps, 1)
    sched = optax.warmup_cosine_decay_schedule(0.0, cfg.inner.lr, warmup, max(steps, warmup + 1), cfg.inner.lr * 0.1)
    if start_step:
        base = sched
        sched = lambda count: base(count + start_step) * jnp.minimum(1.0, (count + 1) / warmup)  # noqa: E731
    return optax.chain(optax.clip_by_global_norm(cfg.inner.grad_clip),
                       optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=cfg.inner.weight_decay))


@pytest.mark.parametrize("start_step", [0, 37])
def test_one_compiled_adamw_step_serves_every_start_step(start_step):
    cfg = build_config({"inner": {"steps": 100, "warmup_steps": 10, "lr": 0.1}})
    params = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4), "b": jnp.ones(4)}
    loss = lambda p, x: jnp.sum((x @ p["w"] + p["b"]) ** 2)  # noqa: E731
    batch = jnp.arange(6.0).reshape(2, 3) / 6
    warm = learner.make_train_step(loss, adamw(cfg, 0, 100))   # what a spare compiles, knowing no start step
    opt = adamw(cfg, start_step, 100)
    assert warm.lower(params, opt.init(params), batch).as_text() == \
        learner.make_train_step(loss, opt).lower(params, opt.init(params), batch).as_text()
    ref_opt = _old_adamw(cfg, start_step, 100)
    ref = learner.make_train_step(loss, ref_opt)
    p, s, q, r = params, opt.init(params), params, ref_opt.init(params)
    for _ in range(15):  # through the restart's warmup
        p, s, _ = warm(p, s, batch)
        q, r, _ = ref(q, r, batch)
    for name in params:
        np.testing.assert_array_equal(np.asarray(p[name]), np.asarray(q[name]), err_msg=name)


def test_spares_refuse_what_a_spare_cannot_warm_up():
    with pytest.raises(ConfigError, match=r"run.spares \(1\): .*model.script"):
        build_config({"run": {"spares": 1}, "model": {"script": "train.py"}})
    with pytest.raises(ConfigError, match=r"run.spares \(2\): .*parallel.processes=2"):
        build_config({"run": {"spares": 2}, "parallel": {"processes": 2}})


@pytest.mark.integration
def test_a_bad_assignment_says_what_is_wrong(tiny_config):
    cfg = tiny_config(inner={"steps": 50})  # main() warms up against the session's services first
    assert spare.read_assignment(cfg, '{"learner": "eu-1", "start_step": 20}\n') == ("eu-1", 20)
    for line, what in [("", "stdin closed"), ("us-0 3", "expected"), ('{"learner": "us-0"}', "expected"),
                       ('{"learner": "ap-0", "start_step": 1}', "'ap-0' is not a learner"),
                       ('{"learner": "us-0", "start_step": 51}', "not in 0..50"),
                       ('{"learner": "us-0", "start_step": "3"}', "not in 0..50")]:
        with pytest.raises(ConfigError, match=what):
            spare.read_assignment(cfg, line)
    with pytest.raises(ConfigError, match="stdin closed"):
        spare.main(cfg.model_copy(update={"run": cfg.run.model_copy(update={"id": "r"})}), "r", io.StringIO())


def _records(log: Path, msg: str) -> list[dict]:
    out = []
    for line in log.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("msg") == msg:
            out.append(rec)
    return out


@pytest.mark.integration
@pytest.mark.exclusive  # the handover is timed
def test_a_warm_spare_takes_a_killed_learners_place_within_seconds(tiny_config):
    # On the defaults' merge (preset decoupled), not the paper's: two learners, one killed, make most
    # deltas late (99-123 of 163-172 here), and the paper's RDA with Nesterov 0.9 and overwrite, which
    # nothing discounts for lateness, ended above the start loss in one CI run of this handover test
    # (5.47 -> 5.98; 3.2-4.3 in ten others, warm and cold starts alike). On the defaults, six runs ended
    # at 2.75-2.81 with 2-6 deltas late (a learner ahead holds its next delta). The merges have tests of their own.
    cfg = tiny_config(preset="decoupled", inner={"steps": 200}, run={"spares": 1, "heartbeat_s": 0.25},
                      regions=[{"name": "us", "learners": 1, "speed": 0.25}, {"name": "eu", "learners": 1, "speed": 0.25}],
                      syncer={"quorum": 2, "incomplete_timeout_s": 5.0})
    console = Console(quiet=True)
    setup = prepare(cfg, console)
    logs = setup.run_dir / "logs"
    jobs = LocalJobs(logs, child_env(setup.cfg))
    run = open_run(setup, jobs, console, [])

    def kill_once_the_spare_is_warm(r):  # mid-run, so that the spare's warm-up is not what is measured
        if not r.ledger.kill_counts and not r.kills and (logs / "spare-0.log").exists() \
                and _records(logs / "spare-0.log", "spare ready") and r.prog.learners.get("us-0", {}).get("step", 0) >= 20:
            r.kills.append(chaos.Kill("us-0", 0.0))

    try:
        run.watch(False, setup.t_start, on_tick=kill_once_the_spare_is_warm)
    finally:
        jobs.stop_all()
        run.events.close()
    s = finish(setup, run, console)
    assert s["kills"] == {"us-0": 1} and s["restarts"] == {"us-0": 1}
    [handover] = s["spare_handovers"]
    assert handover["learner"] == "us-0" and handover["spare"] == "spare-0"
    # the killed learner's next incarnation is the spare's process: it joined as us-0, mid-run, from the
    # step the runner read off the syncer's records (beats are advisory: issue 53 H2), once the syncer had
    # read all the killed learner wrote (issue 53 item 4: here a delta [17, 27) acked just before the
    # kill was once accepted after the handover had read the records and resumed at 20)
    [joined] = _records(logs / "spare-0.log", "joined")
    assert joined["learner"] == "us-0" and joined["start_step"] == handover["start_step"] > 0
    assert _records(logs / "spare-0.log", "finished")[-1]["step"] == 200
    incarnations = Counter(lid for lid, _ in {(e["learner"], e["incarnation"]) for e in run_events(cfg, s["run_id"])
                                              if e["kind"] == "heartbeat"})
    assert incarnations == {"us-0": 2, "eu-0": 1}
    # a cold restart needs the interpreter, JAX and a compile (16-17 s here): a spare only joins
    assert 0 < s["outages_s"]["us-0"] < 6.0, s["outages_s"]
    assert (logs / "spare-1.log").exists()      # a new spare started behind the one that took over
    c = s["contributions"]
    assert c["applied_twice"] == 0 and c["pending"] == 0
    assert c["published"] == c["applied"] + c["rejected"]
    assert s["coverage"]["totals"]["tokens_twice"] == 0, s["coverage"]
    assert set(s["rejections"]) <= {"incomplete"}
    assert_exact_accounting(cfg, s["run_id"])
    assert s["eval_loss_end"] < s["eval_loss_start"]
