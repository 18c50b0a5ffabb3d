"""Figures of benchmark results (matplotlib, no display, no JAX). The records' figures, tau
against gamma and the SL histogram, are `distillspec.tables`'.

`plot_lookahead_sweep`: the modeled latency of the dynamic lookahead policies against static
SL-opt over the draft's cost c, one panel per r_gamma (`benchmarks.disco`'s sweep).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any


def plot_lookahead_sweep(
    rows: Sequence[Mapping[str, Any]], path: str | os.PathLike, policies: Sequence[str]
) -> None:
    """PNG, modeled: each policy's latency reduction against static SL-opt (%) over draft cost c
    (log scale), one panel per r_gamma; rows as `benchmarks.disco.modeled_sweep` makes them."""
    import matplotlib

    matplotlib.use("Agg")  # No display; must precede pyplot's import.
    import matplotlib.pyplot as plt

    panels = sorted({float(r["r_gamma"]) for r in rows})
    if not panels:
        raise ValueError("no sweep rows to plot")
    ncols = min(len(panels), 4)
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(
        nrows, ncols, figsize=(3.6 * ncols, 3.4 * nrows), squeeze=False, sharey=True
    )
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    for ax, r_gamma in zip(axes.flat, panels):
        points = sorted((r for r in rows if float(r["r_gamma"]) == r_gamma), key=lambda r: r["c"])
        for i, name in enumerate(policies):
            ys = [r[f"{name}_vs_static_opt_pct"] for r in points]
            style = "--" if name == "oracle" else "-"
            ax.plot([r["c"] for r in points], ys, style, marker="o", color=f"C{i}", label=name)
        ax.axhline(0.0, color="black", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_xticks([r["c"] for r in points], [f"{r['c']:g}" for r in points], fontsize=8)
        ax.minorticks_off()
        ax.set_title(f"r_γ = {r_gamma:g} (modeled)", fontsize=10)
        ax.set_xlabel("c (draft call / target call)")
        ax.grid(True, alpha=0.3)
    axes.flat[0].set_ylabel("latency below static SL-opt (%)")
    axes.flat[0].legend(fontsize="small")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(os.fspath(path), format="png", dpi=120)
    plt.close(fig)
