"""Which divergence distils the quickstart's draft best? (DistillSpec Section 5.2.)

    python scripts/compare_divergences.py [--quickstart_dir runs/quickstart] \
        [--output_dir runs/divergences] [--divergences fkl rkl jsd tvd] [--gin.NAME=VALUE ...]

Needs a finished quickstart (its target/export and draft/export). For each divergence it reruns
the quickstart's distill stage (same gin settings: warm start from the standard draft,
on-policy data, same steps) into OUTPUT_DIR/<divergence>, then evaluates every distilled draft
with the quickstart's evaluation settings at gamma = 5 and prints the table
(OUTPUT_DIR/table.md; records in OUTPUT_DIR/records.jsonl, drafts named by divergence).
"""

from __future__ import annotations

import argparse
import os

from distillspec import gin_setup, quickstart


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quickstart_dir", default="runs/quickstart")
    parser.add_argument("--output_dir", default="runs/divergences")
    parser.add_argument("--divergences", nargs="+", default=["fkl", "rkl", "jsd", "tvd"])
    args, overrides = parser.parse_known_args()
    target = os.path.join(args.quickstart_dir, "target", "export")
    draft = os.path.join(args.quickstart_dir, "draft", "export")
    for path in (target, draft):
        if not os.path.isdir(path):
            raise SystemExit(f"{path} is missing: run python -m distillspec.quickstart first")
    drafts = {}
    for divergence in args.divergences:
        gin_setup.clear()
        flags = [f"--gin_file={quickstart.GIN_FILE}"] + overrides
        flags.append(f"--gin.distill/LossConfig.divergence='{divergence}'")
        gin_setup.parse_command_line(flags, "train")
        model_dir = os.path.join(args.output_dir, divergence)
        gin_setup.scoped_run("distill", "train")(
            model_dir=model_dir, teacher_checkpoint=target, student_checkpoint=draft
        )
        drafts[divergence] = os.path.join(model_dir, "export")
    gin_setup.scoped_run("evaluate", "evaluate")(
        output_dir=args.output_dir, target_checkpoint=target, drafts=drafts, gammas=[5]
    )


if __name__ == "__main__":
    main()
