"""What the library costs a learner: the same model in the same process as a plain jitted optax
loop and under `diloco.Session`, in alternating blocks of steps, at model sizes and in two layouts
(the demo's: 4 fragments, H = 50; the paper's: 24 fragments, H = 24, so a fragment syncs every step).

Per size and layout: the step's wall time in each loop (median, 10th and 90th percentiles), the time
the training thread spends inside `Session.step` on normal, sync and apply steps apart, the device
bytes the library holds beyond the user's own state (`jax.live_arrays`: every live array in device
memory that is not the parameters, optimizer state, batch or loss), and the host bytes it holds
(anchors kept on the host, versions the fetcher holds, codes waiting in the publisher queue).

Each (size, layout) runs in a process of its own with a run of its own on the local stack (`make up`:
the broker, Redis, a file store): one learner, and the real syncer (quorum 1, so every delta is
merged and comes back as a version to apply) in a second process. On a machine of few cores the
learner process is pinned to one core and the syncer to the others (`--pin`), so that the syncer's
merges do not land in the learner's step times. The batches are fixed random tokens: the data
pipeline is not what is measured.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# name -> (d_model, n_layers) of the built-in transformer (byte-level, 64-dim heads)
SIZES = {"0.5M": (64, 10), "5M": (192, 11), "50M": (640, 10), "200M": (1024, 16), "1B": (2048, 20)}
CPU_SIZES, GPU_SIZES = ["0.5M", "5M", "50M"], ["5M", "200M", "1B"]
LAYOUTS = {"demo": (4, 50), "paper": (24, 24)}  # fragments, H


def _percentiles(xs: list[float]) -> dict:
    import numpy as np

    if not xs:
        return {"median": None, "p10": None, "p90": None, "n": 0}
    a = 1000 * np.asarray(xs)
    return {"median": float(np.median(a)), "p10": float(np.percentile(a, 10)), "p90": float(np.percentile(a, 90)),
            "n": len(xs)}


def _nbytes(a) -> int:
    return sum(s.data.nbytes for s in a.addressable_shards)


def _device_bytes_beyond(user) -> int:
    """Bytes of live arrays in device memory that are not leaves of `user`."""
    import jax

    mine = {id(x) for x in jax.tree_util.tree_leaves(user)}
    return sum(_nbytes(a) for a in jax.live_arrays()
               if id(a) not in mine and a.sharding.memory_kind in (None, "device") and not a.is_deleted())


def _held(session, p: int) -> bool:
    """Whether fragment p waits for a new version (also on a Session from before FragmentState,
    so that this file measures an older checkout too)."""
    return session._fragments[p].held if hasattr(session, "_fragments") else p in session._held


def _host_bytes(session) -> int:
    """Host bytes the session holds: anchors kept on the host, the fetcher's versions, queued codes."""
    import numpy as np

    anchors = session._base.nbytes()["host"] if hasattr(session._base, "nbytes") else 0
    seen, total = set(), anchors
    f = session.fetcher
    arrays = [a for _, arrs in [*f.held.values(), *f.snapshots.values()] if arrs for a in arrs.values()]
    arrays += session._base.bases() if hasattr(session._base, "bases") else []  # shared with the fetcher, or not
    fetched = [got for r in f.ready_now().values() for got in r.values()]
    if fetched and not hasattr(fetched[0], "held_nbytes"):  # before Fetched: the blocks themselves
        arrays += [b for blocks in fetched for bs in blocks.values() for b in bs.values()]
        fetched = []
    for a in arrays:
        if id(a) not in seen and isinstance(a, np.ndarray):
            seen.add(id(a))
            total += a.nbytes
    total += sum(got.held_nbytes(seen) for got in fetched)
    with session.publisher.queue.mutex:
        jobs = list(session.publisher.queue.queue)
    total += sum(np.asarray(d).nbytes if isinstance(d, np.ndarray) else d.nbytes  # codes (before: values)
                 for job in jobs if job for d in job["deltas"].values())
    return total


def worker(args: dict) -> dict:
    """One (size, layout) in this process; returns its row."""
    if args.get("pin") is not None:
        os.sched_setaffinity(0, set(args["pin"]))
    import jax
    import numpy as np

    from diloco.config import build_config, dump_config
    from diloco.fragments import fragments_due
    from diloco.infra import kafka as kafka_io
    from diloco.infra.store import FragmentStore
    from diloco.learners.learner import compile_step, initial_params
    from diloco.learners.parallel import learner_mesh
    from diloco.learners.session import Session
    from diloco.run import provision_run
    from diloco.syncer import state as state_mod

    d_model, layers = args.get("sizes", SIZES)[args["size"]]
    fragments, H = LAYOUTS[args["layout"]]
    run_id = f"bench-learner-{args['size']}-{args['layout']}-{time.time_ns() % 10**9}".replace(".", "")
    work = Path(args["dir"]) / run_id
    work.mkdir(parents=True, exist_ok=True)
    tree = {"model": {"options": {"d_model": d_model, "n_layers": layers, "n_heads": max(d_model // 64, 1),
                                  "seq_len": args["seq_len"]}},
            "regions": [{"name": "us", "learners": 1}],
            "inner": {"steps": 100_000, "batch_size": args["batch_size"]},
            "fragments": {"count": fragments, "sync_every": H, **args.get("fragments", {})},
            "syncer": {"quorum": 1, "grace_max_s": 0.0},
            "store": {"url": f"file://{work}/store"}, "run": {"id": run_id, "dir": str(work)}}
    cfg = build_config(tree, args.get("set", []))
    state = state_mod.SyncerState(state_mod.connect(cfg.state), cfg.state.key_prefix, run_id)
    spec, plan, template = provision_run(cfg, run_id, state=state, store=FragmentStore(cfg.store.url, run_id))
    del template  # the initial tree on the devices: not the library's to count
    (work / "config.yaml").write_text(dump_config(cfg))
    syncer_cores = args.get("syncer_cores")
    syncer = subprocess.Popen(
        [sys.executable, "-m", "diloco", "syncer", "--config", str(work / "config.yaml")],
        stdout=open(work / "syncer.log", "w"), stderr=subprocess.STDOUT,
        preexec_fn=(lambda: os.sched_setaffinity(0, set(syncer_cores))) if syncer_cores else None)
    try:
        mesh = learner_mesh(cfg)
        params = initial_params(cfg, spec, mesh)
        rng = np.random.default_rng(0)
        batch = mesh.shard_batch(rng.integers(0, 256, size=(args["batch_size"], args["seq_len"] + 1)).astype(np.int32))
        tokens = args["batch_size"] * args["seq_len"]
        opt_state, train_step = compile_step(spec, mesh, spec.inner_optimizer(0, 100_000), params, batch)
        session = Session(cfg, "us-0", run_id=run_id)
        session.open()
        params = session.join(params)
        walls = {"plain": [], "session": []}
        library = {"normal": [], "sync": [], "apply": []}
        device_lib, host_lib = [], []

        def block(under_session: bool, steps: int, record: bool):
            nonlocal params, opt_state
            queued, t_prev = None, time.perf_counter()
            for _ in range(steps):
                params, opt_state, loss = train_step(params, opt_state, batch)
                if queued is not None:
                    queued.block_until_ready()
                queued = loss
                if under_session:
                    due = fragments_due(session.steps + 1, plan.fragments, H)
                    before = session.versions
                    t0 = time.perf_counter()
                    params = session.step(params, tokens=tokens, loss=loss)
                    inside = time.perf_counter() - t0
                    synced = [p for p in due if not _held(session, p)]  # or it waits for a new version
                    kind = "apply" if session.versions != before else "sync" if synced else "normal"
                    if record:
                        library[kind].append(inside)
                now = time.perf_counter()
                if record:
                    walls["session" if under_session else "plain"].append(now - t_prev)
                t_prev = now
            jax.block_until_ready(params)
            user = (params, opt_state, batch, queued)
            if record and under_session:  # (after a plain block the session still holds the params it last
                device_lib.append(_device_bytes_beyond(user))  # returned: the user's own, a few steps old)
                host_lib.append(_host_bytes(session))

        block(True, 2 * H, record=False)    # compiles each fragment's sync and apply once
        block(False, 3, record=False)
        for _ in range(args["blocks"]):
            block(False, args["steps"], record=True)
            block(True, args["steps"], record=True)
        deadline = time.monotonic() + 60
        while not (library["sync"] and library["apply"]) and time.monotonic() < deadline:
            block(True, 1, record=True)  # a loaded machine's syncer may not have answered yet
        session.close(hand_in=False)
    finally:
        syncer.send_signal(signal.SIGTERM)
        try:
            syncer.wait(timeout=60)
        except subprocess.TimeoutExpired:
            syncer.kill()
        topics = kafka_io.Topics.for_run(cfg, run_id)  # a local broker keeps every topic in memory
        kafka_io.delete_topics(cfg.transport, [*topics.fragments.values(), topics.outer, topics.events])
    plain, under = _percentiles(walls["plain"]), _percentiles(walls["session"])
    lib = {k: _percentiles(v) for k, v in library.items()}
    per_step = sum(sum(v) for v in library.values()) / max(sum(len(v) for v in library.values()), 1)
    param_bytes = sum(_nbytes(x) for x in jax.tree_util.tree_leaves(params))
    return {"size": args["size"], "params": plan.num_params, "layout": args["layout"], "fragments": fragments, "H": H,
            "anchor": getattr(cfg.fragments, "anchor", "device"),
            "anchor_dtype": getattr(cfg.fragments, "anchor_dtype", "float32"),
            "quantization": cfg.fragments.quantization, "device": jax.devices()[0].platform,
            "step_ms_plain": plain["median"], "step_ms_session": under["median"],
            "step_ms_plain_spread": [plain["p10"], plain["p90"]], "step_ms_session_spread": [under["p10"], under["p90"]],
            "overhead": under["median"] / plain["median"] - 1,
            "library_ms_per_step": {"mean": 1000 * per_step, **{k: v["median"] for k, v in lib.items()}},
            "library_steps": {k: v["n"] for k, v in lib.items()},
            "device_bytes_library": max(device_lib),
            "host_bytes_library": max(host_lib), "param_bytes": param_bytes,
            "largest_fragment_bytes": max(sum(plan.by_name[n].size * 4 for n in names) for names in plan.fragment_names)}


def run(*, sizes: list[str], layouts: list[str], steps: int, blocks: int, batch_size: int = 4, seq_len: int = 64,
        pin: bool = True, overrides: list[str] = (), device: str = "cpu", progress=print,
        sizes_table: dict | None = None) -> list[dict]:
    """Every (size, layout) in its own process; rows as `worker` returns them."""
    cores = sorted(os.sched_getaffinity(0))
    learner_cores = cores[:1] if pin and len(cores) > 1 else None
    syncer_cores = cores[1:] if learner_cores else None
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-learner-") as tmp:
        for layout in layouts:
            for size in sizes:
                args = {"size": size, "layout": layout, "steps": steps, "blocks": blocks, "batch_size": batch_size,
                        "seq_len": seq_len, "pin": learner_cores, "syncer_cores": syncer_cores, "dir": tmp,
                        "set": list(overrides), "sizes": sizes_table or SIZES}
                env = {**os.environ, "JAX_PLATFORMS": device}
                code = f"import json; from bench.learner_bench import worker; print(json.dumps(worker({args!r})))"
                out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                     timeout=3600)
                if out.returncode:
                    raise RuntimeError(f"{size} / {layout} failed:\n{out.stderr[-4000:]}")
                row = json.loads(out.stdout.strip().splitlines()[-1])
                rows.append(row)
                progress(table([row], header=False))
    return rows


def table(rows: list[dict], header: bool = True) -> str:
    lines = ["| layout | params | step plain (ms) | step Session (ms) | overhead | library ms/step: mean, normal, "
             "sync, apply | device bytes (library) | host bytes (library) |",
             "|---|---|---|---|---|---|---|---|"] if header else []
    for r in rows:
        lib = r["library_ms_per_step"]
        fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        lines.append(f"| {r['layout']} | {r['params'] / 1e6:.2f}M | {r['step_ms_plain']:.1f} | "
                     f"{r['step_ms_session']:.1f} | {100 * r['overhead']:+.1f}% | {fmt(lib['mean'])}, "
                     f"{fmt(lib['normal'])}, {fmt(lib['sync'])}, {fmt(lib['apply'])} | "
                     f"{r['device_bytes_library'] / 1e6:.2f} MB | {r['host_bytes_library'] / 1e6:.2f} MB |")
    return "\n".join(lines)


def growth(rows: list[dict]) -> dict[str, float]:
    """Per layout: mean library time per step at the largest size over the smallest."""
    out = {}
    for layout in dict.fromkeys(r["layout"] for r in rows):
        mine = sorted((r for r in rows if r["layout"] == layout), key=lambda r: r["params"])
        if len(mine) > 1:
            out[layout] = mine[-1]["library_ms_per_step"]["mean"] / mine[0]["library_ms_per_step"]["mean"]
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for layout in dict.fromkeys(r["layout"] for r in rows):
        mine = sorted((r for r in rows if r["layout"] == layout), key=lambda r: r["params"])
        ax.plot([r["params"] for r in mine], [r["library_ms_per_step"]["mean"] for r in mine], "o-",
                label=f"{layout}: library ms per step")
        ax.plot([r["params"] for r in mine], [r["step_ms_plain"] for r in mine], "x--", alpha=0.6,
                label=f"{layout}: the plain loop's step")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("parameters")
    ax.set_ylabel("ms")
    ax.set_title("Time on the training thread inside Session.step")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
