"""A learner over N CPU devices, its parameters replicated (data parallel) against sharded (FSDP):
step time, device memory and peak host memory, side by side in one run.

Each layout runs in its own process (`XLA_FLAGS=--xla_force_host_platform_device_count=N`), so its
peak RSS is its own. On CPU devices, device memory is host memory: a replicated learner holds N
copies of the parameters, the optimizer state and the gradients, a sharded one about one. The
publish path is measured too: the codes of the largest fragment's outer deltas made exactly as a
learner's sync does (`learners.outer.outer_deltas`, quantized on the devices) and read by the host
as the publisher reads them, its host allocations traced with tracemalloc; that peak is bounded by
the fragment's codes, not the model.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
import tracemalloc

LAYOUTS = {"replicated": 1, "fsdp": None}  # fsdp over every device


def worker(args: dict) -> dict:
    import jax
    import numpy as np

    from diloco.config import build_config
    from diloco.learners.learner import compile_step
    from diloco.learners.parallel import learner_mesh
    from diloco.learners.outer import Anchors, outer_deltas
    from diloco.models.transformer import spec as transformer
    from diloco.spec import initial_plan

    devices = jax.device_count()
    fsdp = LAYOUTS[args["layout"]] or devices
    cfg = build_config({"model": {"options": {"d_model": args["d_model"], "n_layers": args["layers"], "n_heads": 8,
                                              "seq_len": args["seq_len"]}},
                        "inner": {"batch_size": devices, "steps": 1000},
                        "fragments": {"count": args["fragments"]}, "parallel": {"fsdp": fsdp}})
    spec = transformer(cfg)
    plan, init = initial_plan(cfg, spec)
    mesh = learner_mesh(cfg)
    params = mesh.shard(init, spec.partition(init))
    del init
    opt = spec.inner_optimizer(0, 1000)
    rng = np.random.default_rng(0)
    batch = mesh.shard_batch(rng.integers(0, 256, size=(devices, args["seq_len"] + 1)).astype(np.int32))
    opt_state, step = compile_step(spec, mesh, opt, params, batch)
    params, opt_state, loss = step(params, opt_state, batch)  # warm up
    float(loss)
    times = []
    for _ in range(args["steps"]):
        t0 = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, batch)
        float(loss)
        times.append(time.perf_counter() - t0)
    sizes = [sum(plan.by_name[n].size * 4 for n in names) for names in plan.fragment_names]
    largest = int(np.argmax(sizes))
    names = plan.fragment_names[largest]
    leaves = dict(params)
    base, warm = Anchors("device"), Anchors("device")
    for anchors in (base, warm):
        for n in names:
            anchors[n] = leaves[n].astype(np.float32) + 1e-3  # a global value a little off
    outer_deltas(warm, leaves, names, {n: "int8" for n in names})  # compiles the fragment's sync
    tracemalloc.start()
    deltas = outer_deltas(base, leaves, names, {n: "int8" for n in names})
    codes = {n: d.coded() for n, d in deltas.items()}  # as the publisher reads them
    _, sync_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert set(codes) == set(names)
    return {"layout": args["layout"], "devices": devices, "fsdp": fsdp, "params": plan.num_params,
            "step_ms": 1000 * float(np.median(times)),
            "param_mb_per_device": mesh.bytes_per_device(params) / 1e6,
            "opt_mb_per_device": mesh.bytes_per_device(opt_state) / 1e6,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "largest_fragment_mb": sizes[largest] / 1e6, "model_mb": sum(sizes) / 1e6,
            "sync_host_peak_mb": sync_peak / 1e6}


def run(*, devices: int = 8, d_model: int = 768, layers: int = 4, seq_len: int = 64, fragments: int = 4,
        steps: int = 3) -> dict:
    from diloco.learners.parallel import cpu_devices_env

    rows = {}
    for layout in LAYOUTS:
        args = {"layout": layout, "d_model": d_model, "layers": layers, "seq_len": seq_len, "fragments": fragments,
                "steps": steps}
        env = cpu_devices_env(devices)
        code = f"import json; from bench.sharded_bench import worker; print(json.dumps(worker({args!r})))"
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1800)
        if out.returncode:
            raise RuntimeError(f"{layout} worker failed:\n{out.stderr[-3000:]}")
        rows[layout] = json.loads(out.stdout.strip().splitlines()[-1])
    r, s = rows["replicated"], rows["fsdp"]
    return {"rows": rows, "ratios": {
        "peak_rss": s["peak_rss_mb"] / r["peak_rss_mb"],
        "param_mb_per_device": s["param_mb_per_device"] / r["param_mb_per_device"],
        "opt_mb_per_device": s["opt_mb_per_device"] / r["opt_mb_per_device"],
        "step_ms": s["step_ms"] / r["step_ms"],
        "sync_peak_over_fragment": s["sync_host_peak_mb"] / s["largest_fragment_mb"]}}
