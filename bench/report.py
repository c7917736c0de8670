"""The benchmark's markdown table and plots, from the results dict alone (so they can be redrawn)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from bench import metrics

COLUMNS = ["scenario", "method", "tokens", "held-out loss", "gap to DP", "time to target",
           "bytes across regions (up + down)", "DP bytes / bytes (up only)", "goodput", "learner idle",
           "merge MB/s", "merge p50 / p90 / p99", "accept→merge p50 / p90"]


def targets(results: list[dict]) -> dict[str, float]:
    """Per scenario, the target loss: the worst final loss among its methods, so every method reaches it."""
    out: dict[str, float] = {}
    for r in results:
        out[r["scenario"]] = max(out.get(r["scenario"], -math.inf), r["loss_end"])
    return out


def across(r: dict) -> float:
    """Every byte that crossed regions: learners' deltas up and the globals they fetched down (for
    data-parallel, its all-reduce: what each worker sends, the others receive)."""
    return r["bytes_sent"] + r.get("bytes_fetched", 0)


def _bytes(r: dict) -> str:
    if r["bytes_sent"] is None:  # the ideal method: nothing ran but the math
        return "–"
    total = f"{across(r) / 1e6:,.2f} MB"
    return f"{total} ({r['bytes_sent'] / 1e6:,.2f} + {r['bytes_fetched'] / 1e6:,.2f})" if r.get("bytes_fetched") else total


def _ratios(r: dict) -> str:
    if r["bytes_sent"] is None:
        return "–"
    whole = _fmt(r["bytes_dp"] / across(r) if across(r) else None, ",.0f", "x")
    return f"{whole} ({_fmt(r['bytes_dp'] / r['bytes_sent'], ',.0f', 'x')})" if r.get("bytes_fetched") else whole


def _fmt(x: float, spec: str, suffix: str = "") -> str:
    return "–" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:{spec}}{suffix}"


def _pct(x: float | None) -> float | None:
    return None if x is None else 100 * x


def rows(results: list[dict]) -> list[list[str]]:
    target = targets(results)
    dp = {r["scenario"]: r for r in results if r["method"] == "dp"}
    out = []
    for r in results:
        ref = dp.get(r["scenario"])
        c = r["curve"]
        tt = metrics.time_to_target(c["time_s"], c["loss"], target[r["scenario"]])
        m = r.get("merge")
        out.append([
            r["scenario"], r["method"], f"{r['tokens']:,}", f"{r['loss_end']:.4f}",
            _fmt(metrics.gap_percent(r["loss_end"], ref["loss_end"]) if ref else None, "+.2f", "%"),
            _fmt(tt, ".1f", " s"), _bytes(r), _ratios(r),
            _fmt(_pct(r["goodput"]), ".1f", "%"), _fmt(_pct(r["idle"]), ".1f", "%"),
            _fmt(m["merge_mb_per_s"] if m else None, ".1f"),
            " / ".join(_fmt(1000 * v, ".0f") for v in m["merge_s"].values()) + " ms" if m else "–",
            " / ".join(_fmt(v, ".2f") for v in list(m["accept_to_merge_s"].values())[:2]) + " s" if m else "–",
        ])
    return out


def markdown(results: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row) + " |" for row in rows(results)]
    tgt = ", ".join(f"{s} {v:.4f}" for s, v in targets(results).items())
    return "\n".join(lines) + f"\n\nTarget loss per scenario (worst final loss among its methods): {tgt}\n"


def plot(results: list[dict], out: Path) -> list[str]:
    scenarios = list(dict.fromkeys(r["scenario"] for r in results))
    methods = list(dict.fromkeys(r["method"] for r in results))
    color = {m: f"C{i % 10}" for i, m in enumerate(methods)}  # one colour per method in every panel
    files = []
    for key, xlabel, name in (("tokens", "tokens (all workers)", "loss_vs_tokens.png"),
                              ("time_s", "wall-clock (s)", "loss_vs_time.png")):
        fig, axes = plt.subplots(1, len(scenarios), figsize=(5 * len(scenarios), 4), squeeze=False)
        for ax, sc in zip(axes[0], scenarios):
            for r in results:
                if r["scenario"] == sc and any(math.isfinite(x) for x in r["curve"][key]):  # ideal has no clock
                    ax.plot(r["curve"][key], r["curve"]["loss"], marker="o", ms=3, label=r["method"],
                            color=color[r["method"]])
            ax.set(title=sc, xlabel=xlabel, ylabel="held-out loss (nats)")
            if ax.lines:
                ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        files.append(name)
    sent = [r for r in results if r["bytes_sent"] is not None]  # ideal sends nothing
    return files + (_plot_bytes(sent, out) if sent else [])


def _plot_bytes(results: list[dict], out: Path) -> list[str]:
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(results)), 4))
    labels = [f"{r['method']}\n{r['scenario']}" for r in results]
    ax.bar(range(len(results)), [r["bytes_sent"] / 1e6 for r in results], label="up (deltas; DP: all-reduce)")
    ax.bar(range(len(results)), [r.get("bytes_fetched", 0) / 1e6 for r in results],
           bottom=[r["bytes_sent"] / 1e6 for r in results], label="down (globals)")
    ax.legend(fontsize=7)
    ax.set_xticks(range(len(results)), labels, fontsize=6, rotation=90)
    totals = [across(r) / 1e6 for r in results]
    ax.set(yscale="log", ylabel="MB across regions",
           ylim=(min(r["bytes_sent"] / 1e6 for r in results) / 2, 2 * max(totals)))
    fig.tight_layout()
    fig.savefig(out / "bytes.png", dpi=110)
    plt.close(fig)
    return ["bytes.png"]


GROUP_COLUMNS = ["case", "method", "tokens", "held-out loss", "time to target", "vs the first case",
                 "time to the budget", "vs the first case"]


def group_markdown(name: str, results: list[dict], cases: list[str]) -> str:
    """One table for the cases of a scenario group (e.g. scavenge): one target for all of them (the
    worst final loss among their rows, so every row reaches it), the time to it and to the end of
    the run, each as a ratio to the same method's first case."""
    rows_ = [r for r in results if r["scenario"] in cases]
    target = max(r["loss_end"] for r in rows_)
    times = {(r["method"], r["scenario"]): (metrics.time_to_target(r["curve"]["time_s"], r["curve"]["loss"], target),
                                            r["time_s"]) for r in rows_}
    lines = [f"**{name}** (target loss {target:.4f}, the worst final loss of its cases)\n",
             "| " + " | ".join(GROUP_COLUMNS) + " |", "|" + "---|" * len(GROUP_COLUMNS)]
    for r in sorted(rows_, key=lambda r: (cases.index(r["scenario"]), r["method"])):
        tt, end = times[(r["method"], r["scenario"])]
        base = times.get((r["method"], cases[0]), (None, None))
        lines.append("| " + " | ".join([
            r["scenario"], r["method"], f"{r['tokens']:,}", f"{r['loss_end']:.4f}", _fmt(tt, ".1f", " s"),
            _fmt(tt / base[0] if base[0] else None, ".2f", "x"), _fmt(end, ".1f", " s"),
            _fmt(end / base[1] if base[1] else None, ".2f", "x")]) + " |")
    return "\n".join(lines) + "\n"


SEED_COLUMNS = ["scenario", "method", "seeds", "held-out loss per seed", "mean ± sd", "vs sync (mean)",
                "vs DP (mean)", "time to target, mean ± sd", "goodput, mean", "contributions per merge", "late"]


def _mean_sd(xs: Sequence[float], spec: str, suffix: str = "") -> str:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    if not xs:
        return "–"
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{statistics.fmean(xs):{spec}} ± {sd:{spec}}{suffix}"


def seeds_markdown(results: list[dict]) -> str:
    """Per (scenario, method) over seeds: each seed's final loss, their mean and sample standard
    deviation, the mean's gap to sync DiLoCo's and to data-parallel's, and the time to target (each
    seed's target: the worst final loss of its scenario's methods on that seed)."""
    seeds = sorted({r["seed"] for r in results})
    targets_by_seed = {s: targets([r for r in results if r["seed"] == s]) for s in seeds}
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in results:
        groups.setdefault((r["scenario"], r["method"]), []).append(r)
    mean = {k: statistics.fmean(r["loss_end"] for r in rs) for k, rs in groups.items()}
    lines = ["| " + " | ".join(SEED_COLUMNS) + " |", "|" + "---|" * len(SEED_COLUMNS)]
    for (sc, method), rs in groups.items():
        tts = [metrics.time_to_target(r["curve"]["time_s"], r["curve"]["loss"], targets_by_seed[r["seed"]][sc])
               for r in rs]
        gaps = [_fmt(metrics.gap_percent(mean[(sc, method)], mean[(sc, ref)]) if (sc, ref) in mean else None, "+.2f", "%")
                for ref in ("sync", "dp")]
        lines.append("| " + " | ".join([
            sc, method, str(len(rs)), ", ".join(f"{r['loss_end']:.4f}" for r in rs),
            _mean_sd([r["loss_end"] for r in rs], ".4f"), *gaps, _mean_sd(tts, ".1f", " s"),
            _fmt(_pct(statistics.fmean(r["goodput"] for r in rs) if all(r["goodput"] is not None for r in rs) else None),
                 ".1f", "%"),
            *(_mean_sd([r["merge"].get(k) for r in rs if r.get("merge")], spec, suffix) if any(r.get("merge") for r in rs)
              else "–" for k, spec, suffix in (("round_size", ".2f", ""), ("late_share", ".0%", "")))]) + " |")
    return (f"**Over seeds {', '.join(map(str, seeds))}** (`--seeds`; the table above and the plots are seed "
            f"{seeds[0]}'s)\n\n" + "\n".join(lines) + "\n")


CODEC_COLUMNS = ["method", "up", "down", "seeds", "MB up", "MB down", "all traffic vs DP", "up only vs DP",
                 "held-out loss, mean ± se", "gap to decoupled, paired ± se"]


def _codecs(r: dict) -> tuple[str, str]:
    codecs = r.get("codecs") or {}
    return codecs.get("up", "–"), codecs.get("down", "–")


def _mean_se(xs: Sequence[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else math.nan)


def bytes_quality(results: list[dict], reference: str = "decoupled") -> list[dict]:
    """Per DiLoCo method of the healthy scenario over seeds: bytes up and down, the all-traffic and
    up-only ratios to data-parallel (each the mean of per-seed ratios), the final loss (mean and
    standard error) and its gap to `reference` paired by seed (mean and standard error)."""
    healthy = [r for r in results if r["scenario"] == "healthy" and r["bytes_sent"] is not None
               and r["method"] not in ("dp", "ideal", "ideal-late")]
    by_method: dict[str, dict[int, dict]] = {}
    for r in healthy:
        by_method.setdefault(r["method"], {})[r.get("seed", 0)] = r
    ref = by_method.get(reference, {})
    out = []
    for method, seeds in by_method.items():
        rs = list(seeds.values())
        loss, loss_se = _mean_se([r["loss_end"] for r in rs])
        paired = [metrics.gap_percent(seeds[s]["loss_end"], ref[s]["loss_end"]) for s in seeds if s in ref]
        gap, gap_se = _mean_se(paired) if paired and method != reference else (None, None)
        up, down = _codecs(rs[0])
        out.append({"method": method, "up": up, "down": down, "seeds": len(rs),
                    "mb_up": statistics.fmean(r["bytes_sent"] for r in rs) / 1e6,
                    "mb_down": statistics.fmean(r.get("bytes_fetched", 0) for r in rs) / 1e6,
                    "ratio": statistics.fmean(r["bytes_dp"] / across(r) for r in rs),
                    "ratio_up": statistics.fmean(r["bytes_dp"] / r["bytes_sent"] for r in rs),
                    "loss": loss, "loss_se": loss_se, "gap": gap, "gap_se": gap_se})
    return sorted(out, key=lambda row: row["ratio"])


def bytes_quality_markdown(table: list[dict], reference: str = "decoupled") -> str:
    lines = [f"**Bytes against quality** (healthy; gaps paired by seed against `{reference}`)\n",
             "| " + " | ".join(CODEC_COLUMNS) + " |", "|" + "---|" * len(CODEC_COLUMNS)]
    for row in table:
        gap = "–" if row["gap"] is None else f"{row['gap']:+.2f}% ± {_fmt(row['gap_se'], '.2f', '%')}"
        lines.append("| " + " | ".join([
            row["method"], row["up"], row["down"], str(row["seeds"]), f"{row['mb_up']:.2f}", f"{row['mb_down']:.2f}",
            f"{row['ratio']:,.0f}x", f"{row['ratio_up']:,.0f}x",
            f"{row['loss']:.4f} ± {_fmt(row['loss_se'], '.4f')}", gap]) + " |")
    return "\n".join(lines) + "\n"


def plot_bytes_quality(table: list[dict], out: Path) -> list[str]:
    """Final held-out loss (mean ± se over seeds) against the all-traffic ratio to data-parallel."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, row in enumerate(table):
        se = row["loss_se"] if math.isfinite(row["loss_se"]) else 0.0
        ax.errorbar(row["ratio"], row["loss"], yerr=se, marker="o", capsize=3, color=f"C{i % 10}",
                    label=f"{row['method']} ({row['up']} up, {row['down']} down)")
    ax.set(xscale="log", xlabel="all traffic: data-parallel bytes / bytes (higher is fewer bytes)",
           ylabel="final held-out loss (nats), mean ± se")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "bytes_vs_loss.png", dpi=110)
    plt.close(fig)
    return ["bytes_vs_loss.png"]


def write(results: list[dict], out: Path, header: str = "", groups: dict[str, list[str]] | None = None) -> Path:
    """bench.md and the plots. With several seeds the main table and the plots show the first seed and a
    second table the mean and spread over all of them."""
    out.mkdir(parents=True, exist_ok=True)
    seeds = sorted({r.get("seed", 0) for r in results})
    first = [r for r in results if r.get("seed", 0) == seeds[0]]
    files = plot(first, out)
    ran = {r["scenario"] for r in first}
    tables = [group_markdown(name, first, cases) for name, cases in (groups or {}).items() if ran & set(cases)]
    if len(seeds) > 1:
        tables.append(seeds_markdown(results))
    table = bytes_quality(results)
    if len(table) > 1:
        tables.append(bytes_quality_markdown(table))
        files += plot_bytes_quality(table, out)
    md = out / "bench.md"
    md.write_text(header + markdown(first) + "".join("\n" + t for t in tables) + "\nPlots: " + ", ".join(files) + "\n")
    return md
