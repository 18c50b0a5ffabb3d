"""The results pages: docs/results/*.md (and the PNGs they show), written from run records.

    python -m distillspec.report [--out_dir docs/results] [--quickstart runs/quickstart]
        [--seeds runs/quickstart runs/seed1 runs/seed2] [--disco runs/quickstart]
        [--study runs/study] [--speculative_json runs/benchmarks/speculative.json]
        [--disco_json runs/benchmarks/disco.json]
        [--disco_trained_json runs/benchmarks/disco_trained.json]
        [--train_step_json runs/benchmarks/train_step.json]
        [--versus_trl_json runs/benchmarks/versus_trl.json] [--plan runs/plan]
        [--memory_json runs/benchmarks/memory_recipes.json]
        [--online runs/online] [--recipes_json runs/recipes/summary.json]

Each flag points at one input; its default is where the documented command writes it. A page is
written only for the inputs that exist, and docs/results/README.md lists every page with the
command that produces its input and whether it was generated this time. Each page is stamped
with this command, the git commit, the date and the machine (CPU model, cores, JAX backend).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

from distillspec import plots, seed_spread, tables
from distillspec.records import RECORDS_FILE, eval_set, read_jsonl, timing_warnings
from distillspec.runs import online_report, plan_report
from distillspec.study import recipes_report
from distillspec.study import report as study_report

QUALITY_FILE = "quality.jsonl"
QUALITY_METRICS = ("nll", "distinct_4", "repeating_share")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Page:
    """A results page: its file, title, the command that makes its input, and its writer
    (args, out_dir) -> Markdown body, or None when the input is missing."""

    name: str
    title: str
    producer: str
    write: Callable[[argparse.Namespace, str], str | None]


def build_parser() -> argparse.ArgumentParser:
    """The command line (exposed for tests/test_docs.py, which checks the docs' flags)."""
    parser = argparse.ArgumentParser(
        prog="python -m distillspec.report", description=__doc__.split("\n\n")[0]
    )
    add = parser.add_argument
    add("--out_dir", default="docs/results", help="where the pages go")
    add("--quickstart", default="runs/quickstart", help="a quickstart's output directory")
    add("--seeds", nargs="*", default=[], help="quickstart directories, one per seed (>= 2)")
    add("--disco", default="runs/quickstart", help="python -m distillspec.disco's OUTPUT_DIR")
    add("--study", default="runs/study", help="python -m distillspec.study's output directory")
    add("--speculative_json", default="runs/benchmarks/speculative.json")
    add("--disco_json", default="runs/benchmarks/disco.json")
    add("--disco_trained_json", default="runs/benchmarks/disco_trained.json")
    add("--train_step_json", default="runs/benchmarks/train_step.json")
    add("--versus_trl_json", default="runs/benchmarks/versus_trl.json")
    add("--memory_json", default="runs/benchmarks/memory_recipes.json")
    add("--plan", default="runs/plan", help="python -m distillspec.plan --validate's OUTPUT_DIR")
    add("--online", default="runs/online", help="python -m distillspec.online's OUTPUT_DIR")
    add("--recipes_json", default="runs/recipes/summary.json", help="the recipes' --json OUT")
    return parser


# Provenance ------------------------------------------------------------------------------------


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return ""
    return out.stdout.strip()


def commit() -> str:
    """The short hash of the checked-out commit ('+ local changes' when the tree is dirty)."""
    head = _git("rev-parse", "--short", "HEAD") or "unknown"
    return (
        f"{head} + local changes" if _git("status", "--porcelain", "--untracked-files=no") else head
    )


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's model name (/proc/cpuinfo on Linux, else `platform.processor()`)."""
    try:
        with open(cpuinfo, encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def machine() -> str:
    """'CPU model, N cores, JAX backend B' of this machine."""
    import jax  # Only for the backend's name; the pages themselves need no JAX.

    return f"{cpu_model()}, {os.cpu_count()} cores, JAX backend {jax.default_backend()}"


def stamp(argv: Sequence[str]) -> str:
    """The provenance line each page starts with."""
    command = shlex.join(["python", "-m", "distillspec.report", *argv])
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (
        f"*Generated by `{command}` at commit {commit()} on {date}; machine: {machine()} "
        "(the machine the report ran on, which should be the one that ran its inputs).*"
    )


# Inputs ----------------------------------------------------------------------------------------


def _jsonl(path: str) -> list[dict[str, Any]]:
    return read_jsonl(path) if os.path.isfile(path) else []


def _json(path: str) -> Any:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _grid(run_dir: str) -> list[dict[str, Any]]:
    return [
        r for r in _jsonl(os.path.join(run_dir, RECORDS_FILE)) if not tables.is_policy_record(r)
    ]


def quality_spread(runs: Sequence[Sequence[dict]]) -> list[dict]:
    """Mean ± sd over runs (one per seed) of every (task, split, model)'s quality record."""
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        for r in run:
            groups.setdefault((r["task"], r["split"], r["model"]), []).append(r)
    rows = []
    for (task, split, model), records in groups.items():
        row = {"task": task, "split": split, "model": model, "seeds": len(records)}
        for metric in QUALITY_METRICS:
            row[metric], row[f"{metric}_sd"] = seed_spread.mean_sd([r[metric] for r in records])
        rows.append(row)
    return rows


def _figure(records, plot: Callable, out_dir: str, name: str) -> str:
    """Draws a PNG beside the pages and returns the Markdown that shows it."""
    plot(records, os.path.join(out_dir, name))
    return f"![{name}]({name})"


# Pages -----------------------------------------------------------------------------------------


def quickstart_page(args: argparse.Namespace, out_dir: str) -> str | None:
    grid = _grid(args.quickstart)
    if not grid:
        return None
    table_path = os.path.join(args.quickstart, "table.md")
    quality = _jsonl(os.path.join(args.quickstart, QUALITY_FILE))
    parts = [
        f"Records: `{args.quickstart}`. Summary (what the quickstart prints last):",
        "```\n" + tables.terminal_summary(grid, table_path) + "\n```",
    ]
    sets = {}  # One eval set's records, as the run checked them.
    for r in grid:
        sets.setdefault(eval_set(r), []).append(r)
    warnings = [f"- {name}: {w}" for name, rows in sets.items() for w in timing_warnings(rows)]
    if warnings:  # What the run printed as `[evaluate] warning`, from the same records.
        parts += ["**Timing warnings** (the speed-ups they name are unreliable):\n\n"
                  + "\n".join(warnings)]  # fmt: skip
    parts += [
        "Table C.1, every γ (α and τ with their 95% interval over prompts):",
        tables.to_markdown(tables.records_to_table(grid)),
        _figure(grid, tables.plot_tau_vs_gamma, out_dir, "quickstart_tau_vs_gamma.png"),
    ]
    if quality:
        parts += ["Each model's quality as a model:", tables.to_markdown(quality)]
    return "\n\n".join(parts)


def seeds_page(args: argparse.Namespace, out_dir: str) -> str | None:
    runs = [_grid(d) for d in args.seeds]
    if len(runs) < 2 or not all(runs):
        return None
    quality = [_jsonl(os.path.join(d, QUALITY_FILE)) for d in args.seeds]
    parts = [
        "Runs, one per seed: " + ", ".join(f"`{d}`" for d in args.seeds) + ".",
        "Mean ± standard deviation over the seeds; *Gain > 2 sd*: whether the mean τ gain "
        "exceeds twice its standard deviation.",
        tables.to_markdown(seed_spread.seed_spread_table(runs)),
    ]
    if all(quality):
        parts += ["Each model's quality, mean ± sd:", tables.to_markdown(quality_spread(quality))]
    return "\n\n".join(parts)


def disco_page(args: argparse.Namespace, out_dir: str) -> str | None:
    records_path = os.path.join(args.disco, RECORDS_FILE)
    policies = [r for r in _jsonl(records_path) if tables.is_policy_record(r)]
    if not policies:
        return None
    parts = [f"Records: `{records_path}`.", tables.to_markdown(tables.policy_table(policies))]
    if any(r["policy"] == "oracle" for r in policies):
        name = "disco_oracle_sl_hist.png"
        parts.append(_figure(policies, tables.plot_sl_histogram, out_dir, name))
    f1_path = os.path.join(args.disco, "disco_f1.md")
    if os.path.isfile(f1_path):
        with open(f1_path, encoding="utf-8") as f:
            parts += ["The stop classifier's F1 (DISCO Table 4):", f.read()]
    return "\n\n".join(parts)


def study_page(args: argparse.Namespace, out_dir: str) -> str | None:
    records = _jsonl(os.path.join(args.study, RECORDS_FILE))
    if not records:
        return None
    figures_dir = os.path.join(out_dir, "study")
    os.makedirs(figures_dir, exist_ok=True)
    text = study_report.write_report(records, figures_dir)
    pngs = sorted(n for n in os.listdir(figures_dir) if n.endswith(".png"))
    images = "\n\n".join(f"![{n}](study/{n})" for n in pngs)
    return f"Records: `{args.study}/{RECORDS_FILE}`.\n\n{text}\n\n{images}"


def _flat(result: dict) -> list[dict]:
    """A JSON object's scalar fields and intervals ([low, high]) as rows of (field, value);
    a float below 0.01 keeps three significant digits (it would print as 0.00)."""

    def cell(v):
        if isinstance(v, float) and v and abs(v) < 0.01:
            return f"{v:.3g}"
        if isinstance(v, list) and len(v) == 2 and all(isinstance(x, (int, float)) for x in v):
            return f"[{v[0]:.2f}, {v[1]:.2f}]"
        return v

    scalar = lambda v: v is None or isinstance(v, (str, int, float, bool))
    rows = [{"field": k, "value": cell(v)} for k, v in result.items()]
    return [row for row in rows if scalar(row["value"])]


SPECULATIVE_COLUMNS = (
    "dtype", "batch", "gamma", "alpha", "tau", "c", "r_gamma", "speedup_ideal", "speedup",
    "efficiency", "exact_greedy", "plain_latency_ms", "speculative_latency_ms",
)  # fmt: skip


def speculative_page(args: argparse.Namespace, out_dir: str) -> str | None:
    records = _json(args.speculative_json)
    if not records:
        return None
    rows = [{k: r.get(k) for k in SPECULATIVE_COLUMNS} for r in records]
    pair = records[0].get("pair", "")
    return "\n\n".join([
        f"Result: `{args.speculative_json}`. Pair: {pair}",
        "S* = `speedup_ideal` = τ / (γc + r_γ); η = `efficiency` = measured / S* "
        "(see [evaluation](../evaluation.md)).",
        tables.to_markdown(rows),
    ])  # fmt: skip


POLICY_COLUMNS = ("latency_ms", "modeled_latency_ms", "speedup", "mean_sl", "tau", "exact")
SWEEP_POLICIES = ("heuristic", "confidence", "disco", "cumulative", "oracle")


def _disco_result_page(path: str, out_dir: str, figure: str) -> str | None:
    """A DISCO benchmark's JSON as DISCO Table 1 (every policy, its latency reduction against
    static SL-opt and, for the headline policies, its 90% interval over the test prompts), the
    pair's costs, and the modeled sweep's figure and table when the run made one."""
    result = _json(path)
    if not result:
        return None
    measured = result.get("policies", {})
    opt = measured.get("static-opt", {}).get("latency_ms")
    rows = []
    for name, figures in measured.items():
        row = {"policy": name, **{k: figures.get(k) for k in POLICY_COLUMNS}}
        if opt:
            row["vs_static_opt_pct"] = round(100.0 * (opt - figures["latency_ms"]) / opt, 2)
        interval = result.get(f"{name}_vs_static_opt_pct_interval")
        row["interval_90"] = f"[{interval[0]:+.1f}, {interval[1]:+.1f}]" if interval else ""
        if "own_work_ms" in result:  # Runs before the column have none.
            row["own_work_ms"] = result["own_work_ms"].get(name)
        rows.append(row)
    costs = {k: result.get(k) for k in ("c", "r_gamma", "r_gamma_width", "memory_bound")}
    parts = [
        f"Result: `{path}`. Pair: {result.get('pair', '')}",
        f"Batch 1, greedy, {result.get('test_prompts')} test prompts x "
        f"{result.get('timing_repeats')} timings (median per prompt), "
        f"{result.get('max_new_tokens')} new tokens; every policy's output compared with the "
        f"target's: all exact = {result.get('all_exact')}. Measured costs on this machine: "
        + ", ".join(f"{k} = {v}" for k, v in costs.items()) + ".",
        "Every policy (latency in ms per token; *Latency vs static-opt*: its reduction against "
        "static SL-opt, and `interval_90` its 90% bootstrap interval over the test prompts; "
        "*Own work*: the decoder's work per round outside the model calls, the cost model's "
        "fitted terms at the policy's counts):",
        tables.to_markdown(rows),
        "Tuned settings and the other figures:",
        tables.to_markdown(_flat(result)),
    ]  # fmt: skip
    sweep = result.get("sweep")
    plot = lambda rows, png: plots.plot_lookahead_sweep(rows, png, SWEEP_POLICIES)
    if sweep:
        parts += [
            "**Modeled, not measured**: each configuration's counted calls on the test prompts "
            "priced with synthetic costs (a target call linear in its width, r_γ at γ = 5; a "
            "draft call c; the decoder's own work free), every rule tuned for each profile on "
            "the validation prompts' counts. Latency reduction against static SL-opt (%):",
            _figure(sweep, plot, out_dir, figure),
            tables.to_markdown(sweep),
        ]
    return "\n\n".join(parts)


def disco_benchmark_page(args: argparse.Namespace, out_dir: str) -> str | None:
    return _disco_result_page(args.disco_json, out_dir, "disco_benchmark_sweep.png")


def disco_trained_page(args: argparse.Namespace, out_dir: str) -> str | None:
    return _disco_result_page(args.disco_trained_json, out_dir, "disco_trained_sweep.png")


def _record_page(path: str, result: Any = None) -> str | None:
    """A benchmark's one JSON record (`result`, or read from `path`) as a field | value table."""
    result = _json(path) if result is None else result
    if not result:
        return None
    return f"Result: `{path}`.\n\n" + tables.to_markdown(_flat(result))


def train_step_page(args: argparse.Namespace, out_dir: str) -> str | None:
    """The record's fields, then the pretraining step's products, each timed alone."""
    result = _json(args.train_step_json)
    page = _record_page(args.train_step_json, result)
    products = (result or {}).get("pretrain_step_products")
    if not page or not products:
        return page
    rows = [{"lhs": "x".join(map(str, p["lhs"])), "rhs": "x".join(map(str, p["rhs"])),
             "contracting (lhs; rhs)": "{}; {}".format(*p["dimension_numbers"][0]),
             "batch (lhs; rhs)": "{}; {}".format(*p["dimension_numbers"][1]),
             "count": p["count"], "ms alone": p["ms"], "GFLOP/s": p["gflops"]}
            for p in products]  # fmt: skip
    return (
        page + "\n\nThe pretraining step's products (from its compiled program), each run alone "
        "on random operands of its shapes; `pretrain_step_products_ms` is the sum of count x ms "
        "(each ms includes one jitted call, `empty_call_ms`).\n\n" + tables.to_markdown(rows)
    )


def versus_trl_page(args: argparse.Namespace, out_dir: str) -> str | None:
    return _record_page(args.versus_trl_json)


def memory_page(args: argparse.Namespace, out_dir: str) -> str | None:
    """Per recipe and mesh: the cheapest setting that fits and the tokens per device it fits."""
    result = _json(args.memory_json)
    if not result:
        return None
    gb = lambda n: f"{n / 1e9:.1f}"
    rows = []
    for row in result["rows"]:
        r = row["result"]
        rows.append({
            "recipe": row["recipe"], "mesh": row["mesh"], "row": row["role"],
            "fits": "yes" if row["fits"] else "no",
            "tokens per device": row["tokens_per_device"], "teacher": row["teacher_dtype"],
            "FSDP": "yes" if row["fsdp"] else "no", "student remat": row["remat"],
            "peak GB per chip": gb(r["peak_bytes_per_device"]), "of which temporaries": gb(
                r["temp_bytes"]), "student + optimizer + teacher GB": " + ".join(
                gb(r[k]) for k in ("param_bytes", "optimizer_bytes", "teacher_bytes")),
            f"step s at {r['mfu']:.0%} MFU": f"{r['projected_step_s'][row['accelerator']]:.2f}",
            "dry run s": f"{row['recipe_seconds']:.0f}",
        })  # fmt: skip
    return (
        f"Result: `{args.memory_json}` (divergence {result['divergence']}, AdamW, per chip). "
        "Per mesh, 'cheapest' is the first setting, cheapest first (float32 teacher; bfloat16 "
        "teacher; + FSDP; + remat of the matmul outputs; + full remat), whose compiled step fits "
        "the chip's memory at 4,096 tokens per device (2,048 x 2 for the 2,048-token recipes), "
        "with the most tokens per device (doubling, up to 32,768) it still fits; 'most tokens' "
        "is the same doubling at the last setting. Where even the last setting does not fit 4,096 "
        "tokens, the row halves them down to one row per device, and shows that step's figures "
        "if nothing fits. 'dry run s' is the recipe's whole search on this machine.\n\n"
        + tables.to_markdown(rows)
    )


def _copy_figure(run_dir: str, name: str, out_dir: str) -> bool:
    """Copies run_dir/name beside the pages, if the run wrote it."""
    path = os.path.join(run_dir, name)
    if os.path.isfile(path):
        shutil.copyfile(path, os.path.join(out_dir, name))
    return os.path.isfile(path)


def plan_page(args: argparse.Namespace, out_dir: str) -> str | None:
    """The plan's check (validation.json), then the plan it checked (plan.md, plan.png)."""
    check = _json(os.path.join(args.plan, "validation.json"))
    if not check:
        return None
    plan_md = os.path.join(args.plan, "plan.md")
    page = plan_report.validation_markdown(check)
    if os.path.isfile(plan_md):
        with open(plan_md) as f:
            body = f.read().split("\n", 1)[1]  # Without its title.
        page += "\n## The plan it checks\n" + body
        _copy_figure(args.plan, "plan.png", out_dir)
    return page


def online_page(args: argparse.Namespace, out_dir: str) -> str | None:
    """The online run's figures and goals (online.json), with its plot."""
    result = _json(os.path.join(args.online, "online.json"))
    if not result:
        return None
    page = online_report.markdown(result)
    if _copy_figure(args.online, "online.png", out_dir):
        page += "\n![served alpha per chunk](online.png)\n"
    return page


QUICKSTART_CMD = "python -m distillspec.quickstart"
PAGES = (
    Page("quickstart.md", "The main job: Table C.1 and quality", QUICKSTART_CMD, quickstart_page),
    Page(
        "seeds.md",
        "The main job over seeds (one quickstart per --gin.SEED; report --seeds DIR DIR ...)",
        f"{QUICKSTART_CMD} --output_dir runs/seed1 --gin.SEED=1",
        seeds_page,
    ),
    Page(
        "disco.md",
        "Dynamic lookahead on the main job's models (DISCO Table 1)",
        "python -m distillspec.disco --gin_file=experiments/disco_quickstart.gin",
        disco_page,
    ),
    Page("study.md", "The paper study", "python -m distillspec.study", study_page),
    Page(
        "speculative.md",
        "Benchmark: speculative decoding against S*",
        "python -m distillspec.benchmarks.speculative --json runs/benchmarks/speculative.json",
        speculative_page,
    ),
    Page(
        "disco_benchmark.md",
        "Benchmark: DISCO on the memory-bound reference pair",
        "python -m distillspec.benchmarks.disco --json runs/benchmarks/disco.json",
        disco_benchmark_page,
    ),
    Page(
        "disco_trained.md",
        "Benchmark: DISCO on the trained memory-bound pair (the main job's models, the target "
        "padded with zero-output blocks: logits unchanged)",
        "python -m distillspec.benchmarks.disco --pair trained --draft distilled --json "
        "runs/benchmarks/disco_trained.json",
        disco_trained_page,
    ),
    Page(
        "train_step.md",
        "Benchmark: where a distillation step's time goes",
        "python -m distillspec.benchmarks.train_step --json runs/benchmarks/train_step.json",
        train_step_page,
    ),
    Page(
        "versus_trl.md",
        "Benchmark: the on-policy distillation step against TRL's GKDTrainer (same pair, "
        "prompts and recipe, one process)",
        "python scripts/versus_trl.py --json runs/benchmarks/versus_trl.json",
        versus_trl_page,
    ),
    Page(
        "memory.md",
        "Will my run fit? The distillation step's memory for three real recipes on three meshes",
        "python -m distillspec.benchmarks.memory_recipes",
        memory_page,
    ),
    Page(
        "plan.md",
        "The draft plan checked: predicted against measured speed-up of fully trained candidates",
        "python -m distillspec.plan --gin_file=experiments/plan_quickstart.gin --validate",
        plan_page,
    ),
    Page(
        "online.md",
        "Online distillation: the main job's draft adapting to a drifted stream it serves",
        "python -m distillspec.online --gin_file=experiments/online_quickstart.gin",
        online_page,
    ),
)


def recipes_page(args: argparse.Namespace, out_dir: str) -> str | None:
    summary = _json(args.recipes_json)
    if summary is None:
        return None
    return f"Summary: `{args.recipes_json}`.\n\n{recipes_report.markdown(summary)}"


PAGES += (
    Page(
        "recipes.md",
        "Recipes at one budget: DistillSpec's divergences, the LK losses and AdaSPEC",
        "python -m distillspec.study --gin_file=experiments/recipes_quickstart.gin --json "
        "runs/recipes/summary.json",
        recipes_page,
    ),
)


def index(written: dict[str, bool], argv: Sequence[str], out_dir: str) -> str:
    """docs/results/README.md: every page, the command behind its input, whether it is here."""
    lines = [
        "# Results",
        "",
        "Written by `python -m distillspec.report` from the records of the runs below; do not "
        "edit by hand. Each page names the command, commit, date and machine it came from.",
        "",
        f"Last run: `{shlex.join(['python', '-m', 'distillspec.report', *argv])}`.",
        "",
        "| page | input made by | generated by the last run |",
        "|---|---|---|",
    ]
    for page in PAGES:
        kept = os.path.isfile(os.path.join(out_dir, page.name))
        link = f"[{page.title}]({page.name})" if kept else page.title
        state = "yes" if written[page.name] else "no: input not found"
        if kept and not written[page.name]:
            state += "; the page is from an earlier run (see its stamp)"
        lines.append(f"| {link} | `{page.producer}` | {state} |")
    return "\n".join(lines) + "\n"


def write_pages(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, bool]:
    """Writes every page whose input exists and the index; {page file: written}."""
    os.makedirs(args.out_dir, exist_ok=True)
    header = stamp(argv)
    written = {}
    for page in PAGES:
        body = page.write(args, args.out_dir)
        written[page.name] = body is not None
        if body is not None:
            text = f"# {page.title}\n\n{header}\n\nInput made by: `{page.producer}`\n\n{body}\n"
            with open(os.path.join(args.out_dir, page.name), "w", encoding="utf-8") as f:
                f.write(text)
    with open(os.path.join(args.out_dir, "README.md"), "w", encoding="utf-8") as f:
        f.write(index(written, argv, args.out_dir))
    return written


def main(argv: Sequence[str] | None = None) -> dict[str, bool]:
    argv = list(sys.argv[1:] if argv is None else argv)
    written = write_pages(build_parser().parse_args(argv), argv)
    for name, done in written.items():
        print(f"{name}: {'written' if done else 'skipped (input not found)'}")
    return written


if __name__ == "__main__":
    main()
