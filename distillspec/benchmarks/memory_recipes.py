"""Will my run fit? The memory dry run (`benchmarks.memory`) for three real recipes on three meshes.

    python -m distillspec.benchmarks.memory_recipes --json runs/benchmarks/memory_recipes.json

For each recipe (the paper's T5 v1.1 XL -> small; Llama-3.1-8B -> Llama-3.2-1B shapes; Gemma-2-9B
-> Gemma-2-2B shapes) and each mesh (a TPU v5e-16, a TPU v5p-8 and 8 x H100), it finds the first
setting of a ladder, cheapest first (a float32 teacher; a bfloat16 teacher; + FSDP; + remat of
the matmul outputs only; + full remat), whose step fits the chips' memory at 4,096 tokens per
device, then doubles the tokens per device while that setting still fits (or, when no setting
fits, halves them down to one row); and the same doubling for the ladder's last setting (the
most tokens a device takes). `python -m
distillspec.report` turns the JSON into docs/results/memory.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

RECIPES = {
    "T5 v1.1 XL -> small (the paper's)": ("t5_1_1_xl", "t5_1_1_small", 512),
    "Llama-3.1-8B -> Llama-3.2-1B shapes": (
        "configs/shapes/llama-3.1-8b.json", "configs/shapes/llama-3.2-1b.json", 2048,
    ),
    "Gemma-2-9B -> Gemma-2-2B shapes": (
        "configs/shapes/gemma-2-9b.json", "configs/shapes/gemma-2-2b.json", 2048,
    ),
}  # fmt: skip
# (name, chips, accelerator in `memory.ACCELERATORS`).
MESHES = (("TPU v5e-16", 16, "tpu-v5e"), ("TPU v5p-8", 4, "tpu-v5p"), ("8 x H100", 8, "h100-80gb"))
LADDER = (
    {"teacher_dtype": "float32", "fsdp": False, "remat": "none"},
    {"teacher_dtype": "bfloat16", "fsdp": False, "remat": "none"},
    {"teacher_dtype": "bfloat16", "fsdp": True, "remat": "none"},
    {"teacher_dtype": "bfloat16", "fsdp": True, "remat": "dots_with_no_batch_dims_saveable"},
    {"teacher_dtype": "bfloat16", "fsdp": True, "remat": "full"},
)
START_TOKENS, MAX_TOKENS = 4096, 32768


def _run(memory, target, draft, length, chips, setting, tokens, divergence) -> dict:
    flags = ["--target_config", target, "--draft_config", draft, "--divergence", divergence,
             "--tokens_per_device", str(tokens), "--sequence_length", str(length), "--mesh",
             str(chips), "--remat", setting["remat"], "--teacher_dtype",
             setting["teacher_dtype"]] + (["--fsdp"] if setting["fsdp"] else [])  # fmt: skip
    return memory.dry_run(memory.build_parser().parse_args(flags))


def _most_tokens(memory, recipe, chips, accelerator, setting, divergence, first=None):
    """(tokens, result): the most tokens per device at which the setting's step fits: doubling
    from START_TOKENS, or halving from it down to one row when that does not fit (tokens 0 and
    the last result when nothing does)."""
    target, draft, length = RECIPES[recipe]
    tokens = max(START_TOKENS, length)
    result = first or _run(memory, target, draft, length, chips, setting, tokens, divergence)
    while not result["fits"][accelerator]:  # Fewer tokens, down to one row per device.
        if tokens // 2 < length:
            return 0, result
        tokens //= 2
        result = _run(memory, target, draft, length, chips, setting, tokens, divergence)
    while tokens * 2 <= MAX_TOKENS:
        bigger = _run(memory, target, draft, length, chips, setting, tokens * 2, divergence)
        if not bigger["fits"][accelerator]:
            break
        result, tokens = bigger, tokens * 2
    return tokens, result


def fit_recipe(memory, recipe: str, divergence: str) -> list[dict]:
    """Rows per mesh: the cheapest setting that fits START_TOKENS per device (and the most
    tokens it fits), then the ladder's last setting and the most tokens it fits."""
    target, draft, length = RECIPES[recipe]
    rows = []
    for mesh_name, chips, accelerator in MESHES:
        row = {"recipe": recipe, "mesh": mesh_name, "chips": chips, "accelerator": accelerator}
        tokens = max(START_TOKENS, length)
        for setting in LADDER:
            result = _run(memory, target, draft, length, chips, setting, tokens, divergence)
            if result["fits"][accelerator]:
                break
        found = _most_tokens(memory, recipe, chips, accelerator, setting, divergence, result)
        rows.append({**row, **setting, "role": "cheapest", "fits": bool(found[0]),
                     "tokens_per_device": found[0] or tokens, "result": found[1]})  # fmt: skip
        if setting != LADDER[-1]:
            found = _most_tokens(memory, recipe, chips, accelerator, LADDER[-1], divergence)
            rows.append({**row, **LADDER[-1], "role": "most tokens", "fits": bool(found[0]),
                         "tokens_per_device": found[0] or tokens, "result": found[1]})  # fmt: skip
    return rows


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--divergence", default="jsd", help="the recipe's divergence")
    parser.add_argument("--json", default="runs/benchmarks/memory_recipes.json")
    args = parser.parse_args(argv)
    most = max(chips for _, chips, _ in MESHES)
    os.environ["XLA_FLAGS"] = (
        f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={most}"
    )
    from distillspec.benchmarks import memory

    rows = []
    for recipe in RECIPES:
        started = time.perf_counter()
        rows += fit_recipe(memory, recipe, args.divergence)
        seconds = time.perf_counter() - started
        for row in rows:
            row.setdefault("recipe_seconds", seconds)
        print(f"[memory] {recipe}: {seconds:.0f} s", file=sys.stderr, flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"divergence": args.divergence, "rows": rows}, f, indent=1)
    print(f"[memory] written to {args.json}", file=sys.stderr)
    return rows


if __name__ == "__main__":
    sys.exit(main() and 0)
