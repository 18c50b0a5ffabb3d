"""How much the quickstart's figures move with the CPU's code path, and that reruns repeat.

    python -m distillspec.benchmarks.reproducibility \
        --gin_file=configs/tests/reduced_quickstart.gin --seeds 0 1 --xla_flags "" "" \
        --xla_flags=--xla_cpu_max_isa=AVX2 --xla_flags=--xla_cpu_max_isa=SSE4_2 \
        --out_dir runs/reproducibility

Runs the quickstart once per (seed, XLA_FLAGS setting) in a fresh process, without the model
cache (every run trains its own models), and prints JSON: per seed and setting its alpha and
tau per (draft, temperature, gamma), and the largest difference to the first setting. A
setting given twice shows whether a rerun on this machine is bit-identical; limiting the
instruction set (AVX2: no AVX-512; SSE4_2: no AVX) stands in for another CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

from distillspec.records import RECORDS_FILE, read_jsonl


def run(gin_file: str, seed: int, flags: str, out_dir: str) -> dict[str, dict[str, float]]:
    env = dict(os.environ, XLA_FLAGS=flags)
    shutil.rmtree(out_dir, ignore_errors=True)  # This script's own run directory: train anew.
    subprocess.run(
        [sys.executable, "-m", "distillspec.quickstart", f"--gin_file={gin_file}",
         f"--output_dir={out_dir}", f"--gin.SEED={seed}", "--gin.quickstart.cache_models=False"],
        env=env, check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    return {
        f"{r['draft']} T={r['temperature']:g} gamma={r['gamma']} {r['task']}": {
            "alpha": r["alpha"], "tau": r["tau"],
        }
        for r in read_jsonl(os.path.join(out_dir, RECORDS_FILE))
    }  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    """The command line (tests/test_docs.py checks the docs' flags against it)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gin_file", default="configs/tests/reduced_quickstart.gin")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument(
        "--xla_flags", action="append", default=None,
        help="an XLA_FLAGS setting (repeat; '' = none); default: '' twice",
    )  # fmt: skip
    parser.add_argument("--out_dir", default="runs/reproducibility")
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    settings = args.xla_flags or ["", ""]
    report = []
    for seed in args.seeds:
        results = []
        for i, flags in enumerate(settings):
            out = os.path.join(args.out_dir, f"seed{seed}_setting{i}")
            results.append(run(args.gin_file, seed, flags, out))
            diff = {
                m: max(abs(results[-1][k][m] - results[0][k][m]) for k in results[0])
                for m in ("alpha", "tau")
            }
            report.append({"seed": seed, "xla_flags": flags, "records": results[-1],
                           "max_abs_difference_to_first": diff})  # fmt: skip
            print(json.dumps(report[-1]), file=sys.stderr, flush=True)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
