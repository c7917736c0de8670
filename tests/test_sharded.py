"""Learners over many devices and hosts, in real runs (broker, Redis, TensorStore, the syncer).

- 8 CPU devices, FSDP: the final global parameters of one device, up to the order of float32 sums (a
  deterministic run: one learner, synchronous rounds, fp32 on the wire).
- A learner of 2 processes (jax.distributed on localhost): its hosts end bit-identical, and with
  the parameters sharded across both hosts each reads only its half; killing one process restarts
  the learner as a whole, without a hang.
"""

from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from diloco import checkpoint
from diloco.infra.store import FragmentStore
from diloco.run import finish, open_run, prepare, train

XLA = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count={}"  # conftest's flags kept


def _quiet() -> Console:
    return Console(file=io.StringIO())


def _records(path: Path, message: str) -> list[dict]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{") and f'"{message}"' in line:
            rec = json.loads(line)
            if rec.get("message") == message or rec.get("msg") == message:
                out.append(rec)
    return out


def _logs(summary: dict) -> Path:
    return Path(summary["run_dir"]) / "logs"


def _final_params(cfg, summary) -> dict[str, np.ndarray]:
    store = FragmentStore(cfg.store.url, summary["run_id"])
    plan = store.read_plan()
    return checkpoint.read_global(store, plan, checkpoint.latest_versions(store, plan))


def _deterministic(tiny_config, **sections):
    """One learner, synchronous rounds that it waits for at once, exact fp32 deltas and broadcasts:
    the run's result depends on the learner's arithmetic only."""
    return tiny_config(regions=[{"name": "us", "learners": 1}],
                       inner={"steps": 40}, fragments={"count": 2, "sync_every": 10, "quantization": "fp32",
                                                       "wait_for_merge": True},
                       syncer={"quorum": 1, "grace_max_s": 0.0, "overlap_steps": 0, "broadcast": "fp32"},
                       outer={"lr": 1.0, "momentum": 0.0}, **sections)


@pytest.mark.integration
def test_fsdp_over_8_devices_trains_to_the_parameters_of_one_device(tiny_config, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", XLA.format(1))
    one = train(_deterministic(tiny_config), progress=False, console=_quiet())
    monkeypatch.setenv("XLA_FLAGS", XLA.format(8))
    cfg8 = _deterministic(tiny_config, parallel={"fsdp": 8})
    eight = train(cfg8, progress=False, console=_quiet())
    (placed1,) = _records(_logs(one) / "us-0.log", "parameters placed")
    (placed8,) = _records(_logs(eight) / "us-0.log", "parameters placed")
    assert placed1["mesh"] == {"data": 1, "fsdp": 1, "tensor": 1}
    assert placed8["mesh"] == {"data": 1, "fsdp": 8, "tensor": 1}
    # sharded: each device holds about an eighth (norm scales stay replicated)
    assert placed8["param_bytes_per_device"] < placed1["param_bytes_per_device"] / 6
    assert placed8["opt_bytes_per_device"] < placed1["opt_bytes_per_device"] / 6
    for s in (one, eight):
        assert s["contributions"]["applied"] == s["contributions"]["published"] >= 2 * 4
    a, b = _final_params(cfg8, one), _final_params(cfg8, eight)
    assert a.keys() == b.keys()
    for n in a:
        # The devices sum the gradients in another order, and Adam magnifies float32 rounding where a
        # gradient is near zero: the runs differ by a few 1e-4 of how far training moved the tensor
        # (4e-4 at most, measured). A sharding mistake (a missing all-reduce, a shard in the wrong
        # place) differs by the order of the movement itself.
        moved = float(np.abs(a[n] - _initial(cfg8, one, n)).max())
        assert moved > 1e-3, n  # it did train: the comparison is not between two untouched models
        assert float(np.abs(b[n] - a[n]).max()) < 2e-3 * moved, n


def _initial(cfg, summary, name):
    store = FragmentStore(cfg.store.url, summary["run_id"])
    plan = store.read_plan()
    p = plan.by_name[name].fragment
    return store.read(p, 0, with_opt=False).params[name]


def _two_hosts(tiny_config, monkeypatch, fsdp: int, **inner):
    monkeypatch.setenv("XLA_FLAGS", XLA.format(2))  # 2 devices per process: 4 in the learner
    return tiny_config(regions=[{"name": "us", "learners": 1}], parallel={"processes": 2, "fsdp": fsdp},
                       inner={"steps": 60, **inner}, syncer={"quorum": 1, "grace_max_s": 0.0},
                       outer={"lr": 1.0, "momentum": 0.0})


@pytest.mark.integration
def test_a_two_host_learner_trains_and_its_hosts_end_bit_identical(tiny_config, monkeypatch):
    cfg = _two_hosts(tiny_config, monkeypatch, fsdp=2)  # fsdp inside each host, data across the two
    s = train(cfg, progress=False, console=_quiet())
    logs = _logs(s)
    joined = [_records(logs / f, "joined")[0] for f in ("us-0.log", "us-0.p1.log")]
    assert sorted(j["host"] for j in joined) == [0, 1] and {j["hosts"] for j in joined} == {2}
    finished = [_records(logs / f, "finished")[-1] for f in ("us-0.log", "us-0.p1.log")]
    assert finished[0]["blocks_digest"] == finished[1]["blocks_digest"]   # replicas across hosts agree
    assert finished[0]["step"] == finished[1]["step"] == 60
    assert finished[0]["versions"] == finished[1]["versions"]
    assert s["contributions"]["applied"] == s["contributions"]["published"] > 0
    assert s["eval_loss_end"] < s["eval_loss_start"]


@pytest.mark.integration
def test_killing_one_host_restarts_the_whole_learner_without_a_hang(tiny_config, monkeypatch):
    cfg = _two_hosts(tiny_config, monkeypatch, fsdp=4)  # parameters sharded across both hosts
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"restart_backoff_s": 0.5})})
    console = _quiet()
    setup = prepare(cfg, console)
    from diloco.infra.jobs import LocalJobs
    from diloco.run import child_env

    jobs = LocalJobs(setup.run_dir / "logs", child_env(setup.cfg))
    run = open_run(setup, jobs, console, [])
    killed: dict[str, float] = {}

    def kill_host_1_midway(r):
        if not killed and r.prog.learners.get("us-0", {}).get("step", 0) >= 20:
            jobs.jobs["us-0"].procs[1].kill()   # one host of the learner dies; the other is left running
            killed["at"] = time.time()

    try:
        run.watch(False, setup.t_start, on_tick=kill_host_1_midway)
    finally:
        jobs.stop_all()
        run.events.close()
    s = finish(setup, run, console)
    assert killed and run.procs.restarts.get("us-0") == 1
    logs = _logs(s)
    shares = [r["share"] for f in ("us-0.log", "us-0.p1.log") for r in _records(logs / f, "fetching this host's blocks")]
    assert len(shares) == 4 and all(0.5 <= x < 0.6 for x in shares), shares  # each host reads its half
    joins = [r for r in _records(logs / "us-0.log", "joined")]
    assert len(joins) == 2 and joins[1]["versions"] != {"0": 0, "1": 0, "2": 0, "3": 0}  # resumed, not restarted
    assert s["contributions"]["applied_twice"] == 0
    assert s["contributions"]["applied"] + s["contributions"]["rejected"] == s["contributions"]["published"]
    assert set(s["rejections"]) <= {"incomplete"}
    assert s["learners"]["us-0"]["step"] == 60 and s["eval_loss_end"] < s["eval_loss_start"]


def test_a_host_reads_only_its_blocks_of_a_stored_tensor(tmp_path):
    """Params are stored in blocks along their longest axis (one object per tensor), so a region
    read touches only its blocks; what comes back equals the slice of the whole."""
    from diloco.infra.store import block_shape

    rng = np.random.default_rng(0)
    big = rng.normal(size=(1024, 256)).astype(np.float32)   # 1 MiB: stored in blocks
    small = rng.normal(size=(8, 4)).astype(np.float32)
    assert block_shape(big.shape, 4) == [256, 256] and block_shape(small.shape, 4) is None
    store = FragmentStore(f"file://{tmp_path}", "r")
    store.write(0, 1, {"big": big, "small": small}, {}, {})
    half = ((512, 1024), (0, 256))
    got = store.read_blocks(0, 1, {"big": [half], "small": [((0, 8), (0, 4))]})
    np.testing.assert_array_equal(got["big"][half], big[512:])
    np.testing.assert_array_equal(got["small"][((0, 8), (0, 4))], small)
    np.testing.assert_array_equal(store.read(0, 1).params["big"], big)     # and whole, as before


def test_a_chain_of_updates_longer_than_the_recursion_limit_is_read(tmp_path):
    """With updates from the previous version (syncer.update_base=previous) a version is a chain of
    updates back to its snapshot; read_params and read_blocks followed it by recursion, once per link,
    so a long snapshot interval crash-looped every learner that read it. They follow it in a loop."""
    import sys

    from diloco import quantize
    from diloco.plan import make_plan

    rng = np.random.default_rng(0)
    value = {"w": rng.normal(size=(4, 6)).astype(np.float32)}
    store = FragmentStore(f"file://{tmp_path}", "r")
    store.write_plan(make_plan(value, fragments=1))
    store.write(0, 0, value, {}, {})
    links = 120
    for v in range(1, links + 1):
        wire, value, _ = quantize.encode_update(value, {"w": value["w"] + 0.01}, {}, "int8")
        store.write(0, v, {}, {}, {}, update=wire, update_scheme="int8", snapshot_at=0)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(100)  # the chain is longer than what may be on the stack
    try:
        params, _ = store.read_params(0, links)
        blocks = store.read_blocks(0, links, {"w": [((0, 4), (0, 6))]})
    finally:
        sys.setrecursionlimit(limit)
    np.testing.assert_array_equal(params["w"], value["w"])
    np.testing.assert_array_equal(blocks["w"][((0, 4), (0, 6))], value["w"])


def test_default_fsdp_placement_and_bad_partition_specs():
    import jax
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from diloco.config import ConfigError
    from diloco.learners.parallel import check_spec, fsdp_specs

    mesh = Mesh(np.array(jax.devices()[:1] * 1).reshape(1, 1, 1), ("data", "fsdp", "tensor"))
    assert fsdp_specs({"w": np.zeros((6, 4))}, mesh) == {"w": P()}   # fsdp 1: replicated
    fake = type("M", (), {"shape": {"data": 1, "fsdp": 4, "tensor": 2}})()
    assert fsdp_specs({"w": np.zeros((6, 8)), "b": np.zeros(3), "s": np.zeros(())}, fake) == \
        {"w": P(None, "fsdp"), "b": P(), "s": P()}                   # the longest axis fsdp divides
    with pytest.raises(ConfigError, match=r"6 does not split over \('fsdp',\) \(4 devices\)"):
        check_spec(P("fsdp", None), (6, 8), fake)
    with pytest.raises(ConfigError, match="names \\['model'\\]"):
        check_spec(P("model"), (8,), fake)


@pytest.mark.integration
def test_a_learner_over_two_hosts_sends_each_hosts_blocks_from_that_host(tiny_config, monkeypatch):
    """With the parameters sharded across both hosts (fsdp 4 over 2 processes), each host codes the
    blocks it holds and sends them itself, as its part of one contribution: nothing is gathered
    (plan.gather is gone), the manifests carry blocks, and every contribution's chunks came from
    both hosts, each sending about half of the payload."""
    from tests.helpers import published_manifests

    cfg = _two_hosts(tiny_config, monkeypatch, fsdp=4, steps=40)
    s = train(cfg, progress=False, console=_quiet())
    manifests = {m.id: m for m in published_manifests(cfg, s["run_id"])}
    assert manifests and s["contributions"]["applied"] == s["contributions"]["published"] == len(manifests)
    assert set(s["rejections"]) == set()
    for m in manifests.values():
        blocked = [t for t in m.tensors if t.block is not None]
        assert blocked and m.packing == "none", m
        assert len({t.name for t in blocked}) < len(blocked)  # a tensor in several blocks, under one name
    logs = _logs(s)
    parts = {host: _records(logs / f, "published part") for host, f in enumerate(("us-0.log", "us-0.p1.log"))}
    by_id: dict[str, dict[int, dict]] = {}
    for host, records in parts.items():
        for r in records:
            assert r["host"] == host
            by_id.setdefault(r["id"], {})[host] = r
    assert set(by_id) == set(manifests)
    for cid, hosts in by_id.items():
        m = manifests[cid]
        assert set(hosts) == {0, 1}, cid                        # both hosts wrote chunks of it
        assert sorted(hosts[0]["chunks"] + hosts[1]["chunks"]) == list(range(m.n_chunks))
        assert hosts[0]["bytes"] + hosts[1]["bytes"] == m.total_bytes
        assert 0.3 < hosts[1]["bytes"] / m.total_bytes < 0.7    # each host its own half, not the whole
    assert s["eval_loss_end"] < s["eval_loss_start"]
