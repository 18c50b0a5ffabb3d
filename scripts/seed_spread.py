"""The quickstart's Table C.1 as mean ± standard deviation over training seeds.

    for seed in 0 1 2; do
      python -m distillspec.quickstart --output_dir runs/seed$seed --gin.SEED=$seed
    done
    python scripts/seed_spread.py runs/seed0 runs/seed1 runs/seed2 --out_dir runs/seeds

Writes seeds.md and seeds.csv (`distillspec.seed_spread.seed_spread_table`: alpha, tau and the tau
ratio distilled / standard per task, temperature and gamma, and whether the gain exceeds twice
its standard deviation over seeds), and quality.md (each model's NLL, distinct-4 and looping
share, mean ± standard deviation), and prints them. `python -m distillspec.report --seeds ...`
writes the same tables as a results page.
"""

from __future__ import annotations

import argparse
import os

from distillspec import seed_spread, tables
from distillspec.records import RECORDS_FILE, read_jsonl
from distillspec.report import quality_spread


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="quickstart output directories, one per seed")
    parser.add_argument("--out_dir", default="runs/seeds")
    args = parser.parse_args()
    grid = [read_jsonl(os.path.join(d, RECORDS_FILE)) for d in args.runs]
    rows = seed_spread.seed_spread_table(grid)
    print(tables.write_markdown(rows, os.path.join(args.out_dir, "seeds.md")))
    tables.write_csv(rows, os.path.join(args.out_dir, "seeds.csv"))
    quality = [read_jsonl(os.path.join(d, "quality.jsonl")) for d in args.runs]
    print(tables.write_markdown(quality_spread(quality), os.path.join(args.out_dir, "quality.md")))


if __name__ == "__main__":
    main()
