"""A seed scenario's report: each claim beside its simulated figure twice, on kvtier's measured engine and on
the hardware roofline, a verdict for each, and the assumption that decides it (a markdown table); sweep plots."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class Claim:
    what: str
    seed: str  # the seed's own figure, as the seed states it
    engine: str  # simulated on kvtier's engine (its measured overheads)
    engine_verdict: str  # supported | not supported | not simulated
    roofline: str  # simulated on the hardware roofline (the measured rates alone)
    roofline_verdict: str
    decided_by: str  # the assumption or measurement the verdict turns on, and where it would flip when known


def claims_table(claims: list[Claim]) -> str:
    lines = ["| claim | seed | kvtier engine | verdict | hardware roofline | verdict | deciding assumption |",
             "| --- | ---: | ---: | --- | ---: | --- | --- |"]
    lines += [f"| {c.what} | {c.seed} | {c.engine} | {c.engine_verdict} | {c.roofline} | {c.roofline_verdict} | "
              f"{c.decided_by} |" for c in claims]
    return "\n".join(lines)


def supported(simulated: float, claimed: float, higher_is_better: bool = True, tolerance: float = 0.1) -> str:
    """``supported`` when the simulation reaches the claim within ``tolerance`` (relative), else ``not supported``."""
    ok = simulated >= claimed * (1 - tolerance) if higher_is_better else simulated <= claimed * (1 + tolerance)
    return "supported" if ok else "not supported"


def solve(f, target: float, lo: float, hi: float, iters: int = 40) -> float:
    """The smallest x in [lo, hi] with f(x) >= target (f increasing), or NaN when f(hi) < target."""
    if f(hi) < target:
        return float("nan")
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if f(mid) >= target else (mid, hi)
    return hi


@dataclass
class Panel:
    x_label: str
    y_label: str
    xs: list
    series: dict  # label -> ys (NaN: infeasible point)
    log_x: bool = False


def plot(path: Path, title: str, panels: list[Panel]) -> Path:
    """One PNG, the panels side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.6), squeeze=False)
    for ax, p in zip(axes[0], panels):
        for label, ys in p.series.items():
            ax.plot(p.xs, ys, marker="o", ms=3, label=label)
        ax.set_xlabel(p.x_label)
        ax.set_ylabel(p.y_label)
        if p.log_x:
            ax.set_xscale("log")
            ax.set_xticks(p.xs, [f"{x:g}" for x in p.xs])
            ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
