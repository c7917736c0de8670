"""The Grafana dashboard (infra/grafana/diloco.json) drawn without Grafana: each panel's queries go
to a Prometheus server's /api/v1/query_range and come back as a grid of small line plots in a PNG
(`diloco dashboard`, docs/operations.md)."""

from __future__ import annotations

import io
import json
import math
import re
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import yaml
from PIL import Image

from diloco import infra

DEFAULT_DASHBOARD = Path(infra.__file__).resolve().parent / "grafana" / "diloco.json"  # package data of diloco.infra
POINTS = 200                # about this many points per series, as Grafana asks for a panel's width
GRAFANA_SCRAPE_S = 15.0     # Grafana's scrape interval for a Prometheus data source that names none
UNITS = {"s": "seconds", "Bps": "bytes/s"}  # Grafana unit ids worth an axis label; none and short say nothing

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w|y)")
_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400, "y": 365 * 86400}
_LEGEND = re.compile(r"\{\{\s*(\w+)\s*\}\}")
_VARIABLE = re.compile(r"\$(\w+)|\$\{(\w+)\}")


class DashboardError(Exception):
    """A dashboard that cannot be read, or a Prometheus that cannot answer one of its queries."""


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str  # Grafana's legendFormat ("" or "__auto": the series' name and labels)


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str
    targets: tuple[Target, ...]


def parse_duration(text: str) -> float:
    """Seconds in a Prometheus duration: "90s", "10m", "1h30m"."""
    if not text or _DURATION.sub("", text):
        raise DashboardError(f"{text!r} is not a duration (e.g. 30s, 10m, 1h30m)")
    return sum(float(n) * _SECONDS[u] for n, u in _DURATION.findall(text))


def parse_time(text: str) -> float:
    """Unix seconds from unix seconds or an ISO 8601 time (UTC when it names no zone)."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        t = datetime.fromisoformat(text)
    except ValueError:
        raise DashboardError(f"{text!r} is neither unix seconds nor an ISO 8601 time") from None
    return (t if t.tzinfo else t.replace(tzinfo=timezone.utc)).timestamp()


def load(path: Path) -> tuple[str, list[Panel]]:
    """The dashboard's title and its panels that have queries, in Grafana's reading order (rows, then columns)."""
    try:
        board = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise DashboardError(f"cannot read the dashboard {path}: {err}") from None
    panels = sorted((p for p in board.get("panels", []) if p.get("targets")),
                    key=lambda p: (p.get("gridPos", {}).get("y", 0), p.get("gridPos", {}).get("x", 0)))
    return board.get("title", Path(path).stem), [
        Panel(p.get("title", ""), p.get("fieldConfig", {}).get("defaults", {}).get("unit", ""),
              tuple(Target(t["expr"], t.get("legendFormat", "")) for t in p["targets"] if t.get("expr")))
        for p in panels]


def step_for(range_s: float, points: int = POINTS) -> float:
    """The query step: whole seconds, about `points` of them across the range."""
    return float(max(1, math.ceil(range_s / points)))


def substitute(expr: str, step_s: float, scrape_s: float) -> str:
    """Grafana's built-in variables in a query, as Grafana fills them for one panel.

    $__rate_interval is max($__interval + scrape interval, 4 x scrape interval): a rate window that
    always holds at least a few samples. Any other variable is refused, naming it."""
    values = {"__interval": step_s, "__rate_interval": max(step_s + scrape_s, 4 * scrape_s)}

    def fill(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        if name not in values:
            raise DashboardError(f"the query {expr!r} uses ${name}, which only Grafana can fill "
                                 f"(known here: {', '.join('$' + v for v in values)})")
        ms = round(values[name] * 1000)  # PromQL durations are whole numbers of a unit
        return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"

    return _VARIABLE.sub(fill, expr)


def legend(fmt: str, labels: dict[str, str]) -> str:
    """A series' name as Grafana's legendFormat writes it: {{label}} is that label's value ("" if absent);
    no format gives name{label="value", ...}."""
    if fmt and fmt != "__auto":
        return _LEGEND.sub(lambda m: labels.get(m.group(1), ""), fmt)
    rest = ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()) if k != "__name__")
    return f"{labels.get('__name__', '')}{{{rest}}}"


def _get(url: str, timeout_s: float) -> dict:
    """A Prometheus API answer's data, or DashboardError with Prometheus's own reason."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            body = json.loads(r.read())
    except urllib.error.HTTPError as err:  # 400/422/503 carry {"status": "error", "error": ...}
        try:
            body = json.loads(err.read())
        except ValueError:
            raise DashboardError(f"HTTP {err.code} {err.reason}") from None
    except (urllib.error.URLError, OSError) as err:
        raise DashboardError(f"unreachable ({getattr(err, 'reason', err)})") from None
    except ValueError:
        raise DashboardError("the answer is not JSON (is this a Prometheus server?)") from None
    if body.get("status") != "success":
        raise DashboardError(f"{body.get('errorType', 'error')}: {body.get('error', body)}")
    return body["data"]


def scrape_interval(prometheus: str, timeout_s: float = 10.0) -> float:
    """The server's global scrape interval (its loaded config), what Grafana would be told to use."""
    try:
        config = yaml.safe_load(_get(f"{prometheus}/api/v1/status/config", timeout_s)["yaml"]) or {}
    except DashboardError as err:
        raise DashboardError(f"Prometheus at {prometheus}: reading its config: {err}") from None
    return parse_duration(config.get("global", {}).get("scrape_interval", "1m"))


def query_range(prometheus: str, expr: str, start: float, end: float, step_s: float,
                timeout_s: float = 30.0) -> list[dict]:
    """One range query's series: [{"metric": labels, "values": [[t, "v"], ...]}, ...]."""
    url = f"{prometheus}/api/v1/query_range?" + urllib.parse.urlencode(
        {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step_s:g}"})
    try:
        data = _get(url, timeout_s)
    except DashboardError as err:
        raise DashboardError(f"Prometheus at {prometheus}: query {expr!r}: {err}") from None
    return data["result"]


def render(prometheus: str, output: Path, start: float, end: float, *, dashboard: Path = DEFAULT_DASHBOARD,
           scrape_s: float | None = None, dpi: int = 80) -> dict[str, int]:
    """Draw every panel of `dashboard` over [start, end] into the PNG `output`; returns each panel's
    title and how many series it drew (0: the panel says "no data")."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    if end <= start:
        raise DashboardError(f"the range ends ({end:.0f}) before it starts ({start:.0f})")
    prometheus = prometheus.rstrip("/")
    title, panels = load(dashboard)
    if not panels:
        raise DashboardError(f"the dashboard {dashboard} has no panel with a query")
    scrape_s = scrape_interval(prometheus) if scrape_s is None else scrape_s
    step_s = step_for(end - start)
    grid = np.arange(start, end + step_s / 2, step_s)
    times = [datetime.fromtimestamp(t, timezone.utc) for t in grid]
    cols = 2
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.4 * cols, 2.6 * rows), squeeze=False,
                             layout="constrained")
    drawn = {}
    for ax, panel in zip(axes.flat, panels):
        series = 0
        for target in panel.targets:
            expr = substitute(target.expr, step_s, scrape_s)
            for s in query_range(prometheus, expr, start, end, step_s):
                ys = np.full(len(grid), np.nan)  # a missing point is a gap, as in Grafana
                ts, vs = zip(*s["values"])
                idx = np.clip(np.rint((np.array(ts, float) - start) / step_s).astype(int), 0, len(grid) - 1)
                ys[idx] = np.array(vs, float)
                ys[~np.isfinite(ys)] = np.nan
                if np.isnan(ys).all():  # e.g. a quantile of a histogram that saw nothing in the window
                    continue
                ax.plot(times, ys, lw=1.2, marker="." if np.isfinite(ys).sum() < 3 else None,
                        label=legend(target.legend, s["metric"]))
                series += 1
        ax.set_title(panel.title, fontsize=10, loc="left")
        ax.set_xlim(times[0], times[-1])
        ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S", tz=timezone.utc))
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if series:
            ax.legend(fontsize=6, loc="upper left", ncol=2 if series > 4 else 1, framealpha=0.6)
            if panel.unit in UNITS:
                ax.set_ylabel(UNITS[panel.unit], fontsize=7)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
            ax.set_yticks([])
        drawn[panel.title] = series
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(f"{title}: {prometheus}, {times[0]:%Y-%m-%d %H:%M:%S} to {times[-1]:%H:%M:%S} UTC, "
                 f"step {step_s:g}s", fontsize=11)
    buf = io.BytesIO()
    fig.savefig(buf, dpi=dpi)
    plt.close(fig)
    buf.seek(0)
    with Image.open(buf) as im:  # line plots need few colours: a 256-colour palette PNG is far smaller
        im.convert("RGB").quantize(256).save(output, optimize=True)
    return drawn
