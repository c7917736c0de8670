"""`python -m bench [--methods ...] [--scenarios ...] [--quick | --size S] [--seeds N] [--output DIR]`
runs the side-by-side benchmark; `python -m bench merge` runs the merge-path micro-benchmark; `python -m bench sharded`
compares a learner's parameters replicated and sharded (FSDP) over CPU devices; `python -m bench learner` measures
what the library costs a learner's training thread and memory against a plain optax loop."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from rich.console import Console

from bench import merge_bench, report, setups, sharded_bench
from diloco import quantize
from diloco.config import TransformerOptions
from diloco.infra.jobs import sigterm_raises


def _list(text: str, allowed) -> list[str]:
    items = [x for x in text.split(",") if x]
    bad = [x for x in items if x not in allowed]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {list(allowed)}")
    return items


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    ap.add_argument("--methods", type=lambda s: _list(s, setups.METHODS), default=["dp", "sync", "decoupled"],
                    help=f"comma-separated, of {', '.join(setups.METHODS)}")
    ap.add_argument("--scenarios", type=lambda s: setups.expand(_list(s, [*setups.SCENARIOS, *setups.GROUPS])),
                    default=[s for s in setups.SCENARIOS if s not in setups.SCAVENGE],
                    help=f"comma-separated, of {', '.join(setups.SCENARIOS)} or a group ({', '.join(setups.GROUPS)}: "
                         "its cases); default: all but the scavenge cases")
    ap.add_argument("--size", choices=list(setups.SIZES), default="full",
                    help="quick (~1 min per DiLoCo run), long (the quick model over 5x the outer steps, ~4 min) "
                         "or full (closer to the demo)")
    ap.add_argument("--quick", dest="size", action="store_const", const="quick", help="the same as --size quick")
    ap.add_argument("--output", type=Path, default=Path(".diloco/bench"))
    ap.add_argument("--points", type=int, default=6, help="held-out evaluations per run")
    ap.add_argument("--seeds", type=int, default=1,
                    help="run every method and scenario with seeds 0..N-1 (data.seed and model.seed: the corpus "
                         "split, batch order and initial parameters); the report adds their mean and spread")
    ap.add_argument("--first-seed", type=int, default=0, metavar="S",
                    help="start the seeds at S (S..S+N-1): more seeds for a figure measured before, without rerunning it")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="base config override for every run (e.g. transport.bootstrap_servers=host:9092)")
    return ap.parse_args(argv)


def parse_merge(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench merge", description=merge_bench.__doc__)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--contributions", type=int, default=4)
    ap.add_argument("--scheme", choices=list(quantize.SCHEMES), default="int8")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="threads of the fused merge (1 = per core figures)")
    ap.add_argument("--no-reference", action="store_true", help="skip timing the NumPy reference path")
    ap.add_argument("--snapshot-every", type=int, default=8, help="store.snapshot_every")
    return ap.parse_args(argv)


def main_merge(argv: list[str]) -> dict:
    a = parse_merge(argv)
    out = merge_bench.run(TransformerOptions(d_model=a.d_model, n_layers=a.layers, n_heads=4), k=a.contributions,
                          scheme=a.scheme, repeats=a.repeats, threads=a.threads, reference=not a.no_reference,
                          snapshot_every=a.snapshot_every)
    print(json.dumps(out, indent=1))
    print(f"merge path: {out['merge_mb_per_s']:.1f} MB/s of contributions ({out['payload_mb']:.2f} MB in "
          f"{1000 * out['merge_s']:.0f} ms), {out['merge_mb_per_s_without_store']:.0f} MB/s without the store write; "
          f"NumPy copy of the same bytes: {out['copy_mb_per_s']:.0f} MB/s ({out['copy_over_merge']:.0f}x faster)")
    print("per phase (ms): " + ", ".join(f"{k} {1000 * v:.0f}" for k, v in out["phases_s"].items()))
    b = out["store_bytes"]
    print(f"store per version: {b['between_snapshots'] / 1e6:.2f} MB between snapshots, {b['snapshot'] / 1e6:.2f} MB "
          f"at a snapshot (every {out['snapshot_every']}), update {b['update'] / 1e6:.2f} MB: "
          f"{b['between_over_update']:.2f}x the update ({b['amortized_over_update']:.2f}x with snapshots amortized); "
          f"merge path with snapshots amortized: {out['merge_mb_per_s_amortized']:.0f} MB/s")
    if "reference_s" in out:
        print(f"NumPy reference math (no store write): {out['reference_mb_per_s']:.1f} MB/s; the fused path without "
              f"the write is {out['fused_over_reference']:.1f}x faster")
    return out


def main_sharded(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench sharded", description=sharded_bench.__doc__)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--fragments", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per layout (after one warm-up step)")
    a = ap.parse_args(argv)
    out = sharded_bench.run(devices=a.devices, d_model=a.d_model, layers=a.layers, seq_len=a.seq_len,
                            fragments=a.fragments, steps=a.steps)
    print(json.dumps(out, indent=1))
    r, s = out["rows"]["replicated"], out["rows"]["fsdp"]
    print(f"{r['params'] / 1e6:.1f}M parameters on {r['devices']} CPU devices | replicated | fsdp | fsdp / replicated")
    for key, what in [("step_ms", "step (ms)"), ("param_mb_per_device", "params per device (MB)"),
                      ("opt_mb_per_device", "optimizer state per device (MB)"), ("peak_rss_mb", "peak host RSS (MB)"),
                      ("sync_host_peak_mb", "host peak of one sync (MB)")]:
        print(f"{what:34s} | {r[key]:10.1f} | {s[key]:8.1f} | {s[key] / r[key]:.2f}")
    print(f"largest fragment {s['largest_fragment_mb']:.1f} MB of a {s['model_mb']:.1f} MB model: a sync's host peak is "
          f"{out['ratios']['sync_peak_over_fragment']:.2f}x the fragment")
    return out


def main_learner(argv: list[str]) -> list[dict]:
    from bench import learner_bench

    ap = argparse.ArgumentParser(prog="python -m bench learner", description=learner_bench.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "gpu"], default="cpu",
                    help="the JAX platform; gpu defaults to larger sizes (one H100: about 8 minutes)")
    ap.add_argument("--sizes", type=lambda s: _list(s, learner_bench.SIZES), default=None,
                    help=f"comma-separated, of {', '.join(learner_bench.SIZES)} (default: "
                         f"{','.join(learner_bench.CPU_SIZES)} on cpu, {','.join(learner_bench.GPU_SIZES)} on gpu)")
    ap.add_argument("--layouts", type=lambda s: _list(s, learner_bench.LAYOUTS), default=list(learner_bench.LAYOUTS),
                    help="demo (4 fragments, H = 50), paper (24 fragments, H = 24)")
    ap.add_argument("--steps", type=int, default=24, help="steps per block")
    ap.add_argument("--blocks", type=int, default=3, help="alternating pairs of blocks (plain loop, Session)")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--no-pin", dest="pin", action="store_false",
                    help="do not pin the learner to one core and the syncer to the others")
    ap.add_argument("--output", type=Path, default=None, help="write results.json and library_time.png here")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="config override (e.g. fragments.anchor=device, transport.bootstrap_servers=host:9092)")
    a = ap.parse_args(argv)
    sizes = a.sizes or (learner_bench.GPU_SIZES if a.device == "gpu" else learner_bench.CPU_SIZES)
    print(learner_bench.table([]), flush=True)
    rows = learner_bench.run(sizes=sizes, layouts=a.layouts, steps=a.steps, blocks=a.blocks, batch_size=a.batch_size,
                             seq_len=a.seq_len, pin=a.pin, overrides=a.set, device=a.device,
                             progress=lambda line: print(line, flush=True))
    for layout, ratio in learner_bench.growth(rows).items():
        print(f"{layout}: library time per step at the largest size is {ratio:.2f}x the smallest's")
    if a.output:
        a.output.mkdir(parents=True, exist_ok=True)
        (a.output / "results.json").write_text(json.dumps(rows, indent=1))
        learner_bench.plot(rows, a.output / "library_time.png")
        print(f"wrote {a.output / 'results.json'} and {a.output / 'library_time.png'}")
    return rows


def main_load(argv: list[str]) -> list[dict]:
    from bench import load
    from diloco.config import load_config

    ap = argparse.ArgumentParser(prog="python -m bench load", description=load.__doc__)
    ap.add_argument("--params", default="1e6,1e7,5e7", help="parameters per fragment, comma-separated")
    ap.add_argument("--learners", default="8,32", help="simulated learners, comma-separated")
    ap.add_argument("--shards", default="1,3", help="syncer shards, comma-separated")
    ap.add_argument("--seconds", type=float, default=20.0, help="measured window per setting")
    ap.add_argument("--period", type=float, default=2.0, help="seconds between two contributions of a learner to a fragment")
    ap.add_argument("--jitter", type=float, default=0.2, help="relative jitter of that period")
    ap.add_argument("--drain", action="store_true",
                    help="publish the window's traffic first, then time the syncer taking it in (its capacity "
                         "with no generator on its cores); default: the generator runs live beside it")
    ap.add_argument("--output", type=Path, default=None, help="also write the rows as JSON here")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="config override (e.g. transport.bootstrap_servers=host:9092, state.redis_url=...)")
    a = ap.parse_args(argv)
    base = load_config(None, a.set)
    rows = load.sweep(base, sizes=[float(x) for x in a.params.split(",")],
                      learners=[int(x) for x in a.learners.split(",")], shards=[int(x) for x in a.shards.split(",")],
                      seconds=a.seconds, period_s=a.period, jitter=a.jitter, progress=lambda r: print(r, flush=True),
                      drain=a.drain)
    print(load.drain_table(rows) if a.drain else load.table(rows))
    # the client the shards read with, and kafka-python's too where that is another: the syncer's
    # intake against each
    ceilings = [load.client_ceiling(base, client=c) for c in dict.fromkeys([base.syncer.consumer, "kafka-python"])]
    for ceiling in ceilings:
        print(f"{ceiling['client']} alone, one process, {ceiling['record_bytes'] // 1024} KiB records: produce "
              f"{ceiling['produce_mb_per_s']:.0f} MB/s, consume {ceiling['consume_mb_per_s']:.0f} MB/s on "
              f"{ceiling['consume_cores']:.2f} cores ({ceiling['consume_mb_per_core_s']:.0f} MB/s per core)")
        if a.drain:
            print("\n".join(load.intake_against_client(rows, ceiling)))
    rows = [*rows, *({"client_ceiling": c} for c in ceilings)]
    if a.output:
        a.output.parent.mkdir(parents=True, exist_ok=True)
        a.output.write_text(json.dumps(rows, indent=1))
    return rows


def run_seed(a: argparse.Namespace, seed: int, console: Console, t0: float, done: list[dict], out: Path) -> list[dict]:
    """Every (method, scenario) pair on one seed; each result is also written to `out` as it ends."""
    from bench import dp as dp_mod
    from bench import ideal, runs
    from diloco.learners.data import eval_batches
    from diloco.pipelines.prepared import corpus_for
    size = a.size
    base = [*a.set, f"data.seed={seed}", f"model.seed={seed}"]
    any_cfg = setups.build("decoupled", "healthy", size, base)
    corpus = corpus_for(any_cfg)
    held = eval_batches(corpus.heldout_tokens(), n_batches=any_cfg.run.eval_batches,
                        batch_size=any_cfg.run.eval_batch_size, seq_len=any_cfg.model.transformer.seq_len)
    results, by_key, dps = [], {}, {}
    # DiLoCo runs first: data-parallel's clock in a scenario borrows the measured step times and outages.
    pairs = sorted(setups.plan(a.methods, a.scenarios), key=lambda ms: ms[0] == "dp")
    for method, scenario in pairs:
        cfg = setups.build(method, scenario, size, base)
        console.rule(f"{method} / {scenario} / seed {seed}  ({time.time() - t0:.0f}s)")
        if method == "dp":
            key = (cfg.num_shards, tuple(dp_mod.phases(cfg)))  # the same training: the scenarios without joins
            dps[key] = dps.get(key) or dp_mod.train_dp(cfg, corpus_for(cfg), held, evals=a.points)
            r = runs.dp_in_scenario(cfg, scenario, dps[key], by_key.get(("decoupled", scenario)))
        elif method in setups.IDEAL_LATE_SHARE:
            r = ideal.as_result(cfg, ideal.train_ideal(cfg, corpus, held, evals=a.points,
                                                       late_share=setups.IDEAL_LATE_SHARE[method]))
        else:
            r = runs.run_diloco(cfg, scenario, held, a.points, console)
        r |= {"method": method, "scenario": scenario, "seed": seed}
        by_key[(method, scenario)] = r
        results.append(r)
        (out / "results.json").write_text(json.dumps(done + results, indent=1, default=str))
    return results


def main(argv: list[str]) -> Path:
    a = parse(argv)
    console = Console(stderr=True)
    a.output.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    results: list[dict] = []
    for seed in range(a.first_seed, a.first_seed + a.seeds):
        results += run_seed(a, seed, console, t0, results, a.output)
    order = {s: i for i, s in enumerate(a.scenarios)}
    results.sort(key=lambda r: (r["seed"], order[r["scenario"]], a.methods.index(r["method"])))
    (a.output / "results.json").write_text(json.dumps(results, indent=1, default=str))
    header = (f"Command: python -m bench {' '.join(argv)}\nDate: {time.strftime('%Y-%m-%d %H:%M %Z')}; "
              f"total {time.time() - t0:.0f}s\n\n")
    md = report.write(results, a.output, header, setups.GROUPS)
    print(md.read_text())
    return md


if __name__ == "__main__":
    args = sys.argv[1:]
    with sigterm_raises():  # so each run's `finally` stops the processes it started
        if args[:1] == ["merge"]:
            main_merge(args[1:])
        elif args[:1] == ["sharded"]:
            main_sharded(args[1:])
        elif args[:1] == ["load"]:
            main_load(args[1:])
        elif args[:1] == ["learner"]:
            main_learner(args[1:])
        else:
            main(args)
