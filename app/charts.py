"""Plotly figures of a run: acceptance per cycle, its histogram, where the time goes, the race.

``CHARTS`` declares them for the Live tab: the layout, the outputs and the values a run ends with
are all built from it, so adding a chart is one entry there (and its figure function here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import plotly.graph_objects as go

from .recording import RunRecord

ACCEPT = "#2e9d5b"
TARGET = "#3468c0"
DRAFT = "#e39b2d"
AR = "#888888"


def _layout(fig: go.Figure, title: str, x: str, y: str) -> go.Figure:
    fig.update_layout(
        title={"text": title, "font": {"size": 14}}, xaxis_title=x, yaxis_title=y, height=260,
        margin={"l": 45, "r": 10, "t": 40, "b": 40}, template="plotly_white", showlegend=True,
        legend={"orientation": "h", "y": -0.3},
    )
    return fig


def acceptance_per_cycle(run: RunRecord | None) -> go.Figure:
    fig = go.Figure()
    if run and run.cycles:
        fig.add_bar(x=[c.index for c in run.cycles], y=[c.num_accepted + 1 for c in run.cycles],
                    marker_color=ACCEPT, name="tokens per cycle")
        if run.tau:
            fig.add_hline(y=run.tau, line_dash="dash", annotation_text=f"τ = {run.tau:.2f}")
    return _layout(fig, "Acceptance length per cycle", "cycle", "tokens committed")


def acceptance_histogram(run: RunRecord | None, block_size: int = 16) -> go.Figure:
    fig = go.Figure()
    if run and run.cycles:
        lengths = [c.num_accepted + 1 for c in run.cycles]
        counts = [lengths.count(n) for n in range(1, block_size + 1)]
        fig.add_bar(x=list(range(1, block_size + 1)), y=counts, marker_color=ACCEPT, name="cycles")
    return _layout(fig, "Histogram of acceptance lengths", "tokens committed in a cycle", "cycles")


def phase_times(run: RunRecord | None) -> go.Figure:
    fig = go.Figure()
    if run and run.cycles:
        x = [c.index for c in run.cycles]
        fig.add_bar(x=x, y=[c.draft_s * 1000 for c in run.cycles], name="drafter", marker_color=DRAFT)
        fig.add_bar(x=x, y=[c.verify_s * 1000 for c in run.cycles], name="verifier (target)", marker_color=TARGET)
        fig.update_layout(barmode="stack")
    return _layout(fig, "Drafter vs verifier time per cycle", "cycle", "ms")


def race(dflash: RunRecord | None, ar: RunRecord | None) -> go.Figure:
    fig = go.Figure()
    for run, name, color in ((dflash, "DFlash", ACCEPT), (ar, "autoregressive", AR)):
        if run and run.timeline:
            fig.add_scatter(x=[0.0] + [t for t, _ in run.timeline], y=[0] + [n for _, n in run.timeline],
                            mode="lines", line={"shape": "hv", "color": color, "width": 3}, name=name)
    return _layout(fig, "The race: tokens over time (common clock)", "seconds", "tokens")


@dataclass(frozen=True)
class Chart:
    name: str  # the page's element id is ``dfs-plot-<name>``
    label: str
    draw: Callable[[RunRecord | None, RunRecord | None, int], go.Figure]  # (DFlash run, baseline run, block size)


CHARTS = (
    Chart("accept", "Acceptance length per cycle", lambda dflash, ar, block: acceptance_per_cycle(dflash)),
    Chart("hist", "Histogram", lambda dflash, ar, block: acceptance_histogram(dflash, block)),
    Chart("phase", "Drafter vs verifier time", lambda dflash, ar, block: phase_times(dflash)),
    Chart("race", "The race", lambda dflash, ar, block: race(dflash, ar)),
)
CHARTS_PER_ROW = 2
