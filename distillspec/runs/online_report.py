"""The online run's figures: the summary and its goals, online.md / online.png, terminal lines.

`summary` reduces the per-chunk records and the frozen-against-adapted comparisons of every
seed to the figures the run is judged by, each the worst over seeds, gammas and temperatures:
alpha_gain (held-out prompts of the stream, adapted - frozen) with its paired 90% interval,
tau_gain_pct, forgetting_alpha_drop (the original test set, frozen - adapted),
recording_cost_pct (batch-1 latency with recording against without, over every chunk's timed
prompts) and teacher_forward_passes (of the adaptation's training steps).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

# The goals of the online run (issue 43): thresholds the summary is checked against.
GOALS = {
    "alpha_gain": 0.05,  # At least, with the 90% interval above 0.
    "tau_gain_pct": 10.0,  # At least.
    "forgetting_alpha_drop": 0.02,  # At most.
    "recording_cost_pct": 3.0,  # At most.
    "teacher_forward_passes": 0,  # Exactly.
}


def _cell(row: Mapping[str, Any]) -> str:
    return f"gamma {row['gamma']}, T {row['temperature']:g}, seed {row['seed']}"


def summary(chunks: Sequence[dict], comparisons: Sequence[dict], context: dict) -> dict[str, Any]:
    """online.json: the context, every chunk and comparison, and the judged figures."""
    held = [r for r in comparisons if r["set"] == "held_out"]
    original = [r for r in comparisons if r["set"] == "original"]
    worst = min(held, key=lambda r: r["alpha_gain"])
    lowest = min(held, key=lambda r: r["alpha_gain_interval"][0])
    tau = min(held, key=lambda r: r["tau_gain_pct"])
    on = sum(c["recording_latency_ms"] for c in chunks)
    off = sum(c["latency_ms"] for c in chunks)
    result = {
        "context": context,
        "alpha_gain": worst["alpha_gain"],
        "alpha_gain_interval": worst["alpha_gain_interval"],
        "alpha_gain_at": _cell(worst),
        "alpha_gain_interval_lowest": lowest["alpha_gain_interval"][0],
        "tau_gain_pct": tau["tau_gain_pct"],
        "tau_gain_at": _cell(tau),
        "forgetting_alpha_drop": None,
        "recording_cost_pct": 100 * (on / off - 1) if off else None,
        "recording_cost_pct_by_chunk": [c["recording_cost_pct"] for c in chunks],
        "teacher_forward_passes": sum(c["teacher_forward_passes"] for c in chunks),
        "train_seconds": sum(c["train_seconds"] for c in chunks),
        "chunks": list(chunks),
        "comparisons": list(comparisons),
    }
    if original:
        drop = max(original, key=lambda r: r["alpha_frozen"] - r["alpha_adapted"])
        result["forgetting_alpha_drop"] = drop["alpha_frozen"] - drop["alpha_adapted"]
        result["forgetting_at"] = _cell(drop)
    result["goals"] = goals(result)
    return result


def goals(result: Mapping[str, Any]) -> dict[str, bool | None]:
    """Each goal met (True), missed (False) or not measured (None)."""
    drop, cost = result["forgetting_alpha_drop"], result["recording_cost_pct"]
    met = {
        "alpha_gain": result["alpha_gain"] >= GOALS["alpha_gain"]
        and result["alpha_gain_interval_lowest"] > 0,
        "tau_gain_pct": result["tau_gain_pct"] >= GOALS["tau_gain_pct"],
        "forgetting_alpha_drop": None if drop is None else drop <= GOALS["forgetting_alpha_drop"],
        "recording_cost_pct": None if cost is None else cost <= GOALS["recording_cost_pct"],
        "teacher_forward_passes": result["teacher_forward_passes"] == 0,
    }
    return {k: None if v is None else bool(v) for k, v in met.items()}


def chunk_line(record: Mapping[str, Any], num_chunks: int) -> str:
    """One progress line per chunk (<= 100 columns)."""
    return (
        f"[online] seed {record['seed']} chunk {record['chunk'] + 1}/{num_chunks}: alpha "
        f"{record['alpha']:.3f} tau {record['tau']:.2f} x{record['latency_speedup']:.2f} "
        f"rec {record['recording_cost_pct']:+.1f}% train {record['train_seconds']:.0f} s"
    )


def _mark(met: bool | None) -> str:
    return {True: "met", False: "**not met**", None: "not measured"}[met]


def markdown(result: Mapping[str, Any]) -> str:
    """online.md (and the results page)."""
    ctx, met = result["context"], result["goals"]
    interval = ", ".join(f"{x:+.3f}" for x in result["alpha_gain_interval"])
    out = [
        f"Draft `{ctx['draft_checkpoint']}` serving target `{ctx['target_checkpoint']}` on "
        f"{ctx['stream_prompts']} prompts of `{ctx['stream'][0]}` ({ctx['stream'][1]}) in "
        f"chunks of {ctx['chunk_prompts']}, served at γ = {ctx['serve_gamma']}, "
        f"T = {ctx['serve_temperature']:g} with the target's top-{ctx['record_top_k']} "
        f"recorded; {ctx['steps_per_chunk']} distillation steps on the buffer after each "
        f"chunk. Seeds {ctx['seeds']}. Held-out: `{ctx['held_out'][0]}` ({ctx['held_out'][1]}); "
        f"forgetting: `{(ctx['original'] or ['none'])[0]}`.\n",
        "| figure (worst over seeds, γ and T) | value | goal | |",
        "|---|---:|---|---|",
        f"| α gain on held-out prompts (adapted − frozen), 90% interval | "
        f"{result['alpha_gain']:+.3f} [{interval}] ({result['alpha_gain_at']}); lowest interval "
        f"bound {result['alpha_gain_interval_lowest']:+.3f} | ≥ +0.05, interval above 0 | "
        f"{_mark(met['alpha_gain'])} |",
        f"| τ gain on held-out prompts | {result['tau_gain_pct']:+.1f}% ({result['tau_gain_at']}) "
        f"| ≥ +10% | {_mark(met['tau_gain_pct'])} |",
    ]  # fmt: skip
    drop = result["forgetting_alpha_drop"]
    out.append(
        "| forgetting: α drop on the original test set | "
        + (f"{drop:+.3f} ({result['forgetting_at']})" if drop is not None else "—")
        + f" | ≤ 0.02 | {_mark(met['forgetting_alpha_drop'])} |"
    )
    cost = result["recording_cost_pct"]
    by_chunk = result["recording_cost_pct_by_chunk"]
    out.append(
        "| recording's cost (batch-1 latency, on against off) | "
        + (f"{cost:+.1f}% (chunks {min(by_chunk):+.1f}…{max(by_chunk):+.1f}%)" if by_chunk else "—")
        + f" | ≤ 3% | {_mark(met['recording_cost_pct'])} |"
    )
    out.append(
        f"| teacher forward passes of the adaptation | {result['teacher_forward_passes']} | 0 | "
        f"{_mark(met['teacher_forward_passes'])} |"
    )
    out += [
        "",
        "Frozen against adapted, per seed, set, γ and T (α's gain with its paired 90% interval "
        "over prompts):\n",
        "| seed | set | γ | T | prompts | α frozen | α adapted | gain [90%] | τ frozen | "
        "τ adapted | τ gain |",
        "|---:|---|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for r in result["comparisons"]:
        low, high = r["alpha_gain_interval"]
        out.append(
            f"| {r['seed']} | {r['set']} | {r['gamma']} | {r['temperature']:g} | {r['prompts']} | "
            f"{r['alpha_frozen']:.3f} | {r['alpha_adapted']:.3f} | {r['alpha_gain']:+.3f} "
            f"[{low:+.3f}, {high:+.3f}] | {r['tau_frozen']:.2f} | {r['tau_adapted']:.2f} | "
            f"{r['tau_gain_pct']:+.1f}% |"
        )
    out += [
        "",
        "Per chunk, as served (α and τ of the chunk's prompts with the draft of that moment; "
        "batch-1 latency speed-up and the recording's cost on its first prompts):\n",
        "| seed | chunk | prompts served | α | τ | latency speed-up | recording | train s | "
        "teacher passes | buffer |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in result["chunks"]:
        out.append(
            f"| {c['seed']} | {c['chunk'] + 1} | {c['prompts_served']} | {c['alpha']:.3f} | "
            f"{c['tau']:.2f} | {c['latency_speedup']:.2f}x | {c['recording_cost_pct']:+.1f}% | "
            f"{c['train_seconds']:.1f} | {c['teacher_forward_passes']} | {c['buffer_examples']} |"
        )
    return "\n".join(out) + "\n"


def plot(result: Mapping[str, Any], path: str) -> None:
    """online.png: each chunk's served alpha against prompts served, per seed, with the frozen
    draft's held-out alpha at the serving gamma and temperature for reference."""
    import matplotlib

    matplotlib.use("Agg")  # No display; must precede pyplot's import.
    import matplotlib.pyplot as plt

    ctx = result["context"]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for i, seed in enumerate(ctx["seeds"]):
        rows = [c for c in result["chunks"] if c["seed"] == seed]
        ax.plot([c["prompts_served"] for c in rows], [c["alpha"] for c in rows], marker="o",
                color=f"C{i}", label=f"served α, seed {seed}")  # fmt: skip
        frozen = [r for r in result["comparisons"] if r["seed"] == seed and r["set"] == "held_out"
                  and r["gamma"] == ctx["serve_gamma"]
                  and r["temperature"] == ctx["serve_temperature"]]  # fmt: skip
        for r in frozen[:1]:
            ax.axhline(r["alpha_frozen"], color=f"C{i}", linestyle=":",
                       label=f"frozen, held-out, seed {seed}")  # fmt: skip
            ax.axhline(r["alpha_adapted"], color=f"C{i}", linestyle="--",
                       label=f"adapted, held-out, seed {seed}")  # fmt: skip
    ax.set_xlabel("prompts served")
    ax.set_ylabel(f"α (γ = {ctx['serve_gamma']}, T = {ctx['serve_temperature']:g})")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="x-small")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=120)
    plt.close(fig)


def write(output_dir: str, result: Mapping[str, Any]) -> None:
    """OUTPUT_DIR/online.md and online.png."""
    with open(os.path.join(output_dir, "online.md"), "w", encoding="utf-8") as f:
        f.write(markdown(result))
    plot(result, os.path.join(output_dir, "online.png"))


def terminal_summary(result: Mapping[str, Any]) -> str:
    """The judged figures, one per line with its goal's verdict (<= 100 columns)."""
    low, high = result["alpha_gain_interval"]
    drop, cost, met = result["forgetting_alpha_drop"], result["recording_cost_pct"], result["goals"]
    mark = lambda key: {True: "(met)", False: "(NOT MET)", None: ""}[met[key]]
    lines = [
        f"alpha gain, held-out, worst: {result['alpha_gain']:+.3f} [{low:+.3f}, {high:+.3f}] "
        f"{mark('alpha_gain')}",
        f"tau gain, held-out, worst: {result['tau_gain_pct']:+.1f}% {mark('tau_gain_pct')}",
        "forgetting, alpha drop on the original set: "
        + ("not measured" if drop is None else f"{drop:+.3f} {mark('forgetting_alpha_drop')}"),
        "recording's cost, batch-1 latency: "
        + ("-" if cost is None else f"{cost:+.1f}% {mark('recording_cost_pct')}"),
        f"teacher forward passes while adapting: {result['teacher_forward_passes']} "
        f"{mark('teacher_forward_passes')}",
    ]
    return "\n".join(lines)
