"""The main job: the embedded default, end to end, in one command.

    python -m distillspec.quickstart [--output_dir runs/quickstart] [--gin.NAME=VALUE ...]

On this machine's own data (the Python standard library's code; HumanEval as a transfer set) it
pretrains a target and a standard draft, distils the draft toward the target starting from the
standard draft's weights (on-policy, as DistillSpec warm-starts from the fine-tuned small model),
evaluates both drafts with the speculative decoder and prints the table. It is a gin pipeline
(configs/experiments/quickstart.gin): each stage is `distillspec.train.train` or
`distillspec.evaluate.evaluate` under a gin scope (target/, draft/, distill/, evaluate/), so any
setting can be overridden, e.g. --gin.distill/LoopConfig.train_steps=400. Rerunning the command
resumes every training stage from its checkpoints.
"""

from __future__ import annotations

import argparse
import os
import sys

from distillspec import gin_setup

GIN_FILE = str(gin_setup.CONFIGS_DIR / "experiments" / "quickstart.gin")


def quickstart(output_dir: str = "runs/quickstart") -> list[dict]:
    """Runs the pipeline under output_dir/{target,draft,distilled} and output_dir/records.jsonl.

    Returns:
      The evaluation records of this run (drafts labelled 'standard' and 'distilled').
    """
    train, evaluate = gin_setup.run_function("train"), gin_setup.run_function("evaluate")
    stage = lambda name: os.path.join(output_dir, name)
    export = lambda name: os.path.join(output_dir, name, "export")
    with gin_setup.scope("target"):
        train(model_dir=stage("target"))
    with gin_setup.scope("draft"):
        train(model_dir=stage("draft"))
    with gin_setup.scope("distill"):
        train(
            model_dir=stage("distilled"),
            teacher_checkpoint=export("target"),
            student_checkpoint=export("draft"),
        )
    with gin_setup.scope("evaluate"):
        return evaluate(
            output_dir=output_dir,
            target_checkpoint=export("target"),
            drafts={"standard": export("draft"), "distilled": export("distilled")},
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--output_dir", default="runs/quickstart")
    args, rest = parser.parse_known_args(argv if argv is not None else sys.argv[1:])
    gin_setup.parse_command_line([f"--gin_file={GIN_FILE}"] + rest, "quickstart")
    gin_setup.run_function("quickstart")(output_dir=args.output_dir)


if __name__ == "__main__":
    main()
