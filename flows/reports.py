"""Run reports as Prefect artifacts: a table per eval, held-out loss against tokens, the final summary."""

from __future__ import annotations

import base64
import io
import re

from prefect.artifacts import create_markdown_artifact, create_table_artifact

from diloco.summary import summary_rows


def artifact_key(run_id: str, what: str) -> str:
    """Artifact keys allow lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]", "-", f"{run_id}-{what}".lower())


def eval_rows(evals: list[dict]) -> list[dict]:
    return [{"version": e["version"], "fragment versions": " ".join(f"p{p}:v{v}" for p, v in enumerate(e["versions"])),
             "tokens": e["tokens"], "loss": round(e["loss"], 4), "perplexity": round(e["perplexity"], 3)}
            for e in evals]


def loss_plot_png(evals: list[dict], title: str) -> bytes:
    import matplotlib
    matplotlib.use("Agg")  # no display on workers
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot([e["tokens"] for e in evals], [e["loss"] for e in evals], marker="o")
    ax.set(xlabel="tokens seen by the global model", ylabel="held-out loss", title=title)
    ax.grid(alpha=0.3)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def summary_markdown(summary: dict) -> str:
    lines = [f"### summary of {summary['run_id']} ({summary['wall_s']:.0f}s)", "", "| what | value |", "|---|---:|"]
    lines += [f"| {what.strip()} | {value} |" for what, value in summary_rows(summary)]
    restarts = summary.get("restarts") or {}
    lines.append(f"| restarts | {', '.join(f'{k} {v}' for k, v in sorted(restarts.items())) or 'none'} |")
    return "\n".join(lines)


def eval_artifact(run_id: str, figures: dict) -> None:
    create_table_artifact(eval_rows([figures]), key=artifact_key(run_id, "eval"),
                          description=f"held-out eval of {run_id} at version {figures['version']}")


def run_artifacts(summary: dict, evals: list[dict]) -> None:
    run_id = summary["run_id"]
    create_table_artifact(eval_rows(evals), key=artifact_key(run_id, "evals"), description=f"held-out evals of {run_id}")
    png = base64.b64encode(loss_plot_png(evals, run_id)).decode()
    create_markdown_artifact(f"![held-out loss against tokens](data:image/png;base64,{png})",
                             key=artifact_key(run_id, "loss-curve"), description="held-out loss against tokens")
    create_markdown_artifact(summary_markdown(summary), key=artifact_key(run_id, "summary"),
                             description=f"summary of {run_id}")
