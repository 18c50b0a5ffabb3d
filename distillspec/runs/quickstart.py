"""The main job's run function: the embedded default, end to end.

On this machine's own data (the Python standard library's code; HumanEval as a transfer set) it
pretrains a target and a standard draft, distils the draft toward the target starting from the
standard draft's weights (on-policy, as DistillSpec warm-starts from the fine-tuned small model),
evaluates both drafts with the speculative decoder and prints the table. Each stage is a run
function (`train`, `evaluate`) configured under a scope (target/, draft/, distill/, evaluate/);
the caller supplies them through `stage`, so this module knows nothing of gin (the command line,
`distillspec.quickstart`, passes gin-configured ones). Rerunning resumes every training stage
from its checkpoints.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

# stage(scope, run name) -> that run function, configured under the scope.
StageFn = Callable[[str, str], Callable[..., Any]]


def quickstart(output_dir: str = "runs/quickstart", *, stage: StageFn) -> list[dict]:
    """Runs the pipeline under output_dir/{target,draft,distilled} and output_dir/records.jsonl.

    Returns:
      The evaluation records of this run (drafts labelled 'standard' and 'distilled').
    """
    path = lambda name: os.path.join(output_dir, name)
    export = lambda name: os.path.join(output_dir, name, "export")
    stage("target", "train")(model_dir=path("target"))
    stage("draft", "train")(model_dir=path("draft"))
    stage("distill", "train")(
        model_dir=path("distilled"),
        teacher_checkpoint=export("target"),
        student_checkpoint=export("draft"),
    )
    return stage("evaluate", "evaluate")(
        output_dir=output_dir,
        target_checkpoint=export("target"),
        drafts={"standard": export("draft"), "distilled": export("distilled")},
    )
