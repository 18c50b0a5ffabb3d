"""The main job's run function: the embedded default, end to end.

On this machine's own data (the Python standard library's code; HumanEval as a transfer set) it
pretrains a target and a standard draft, distils the draft toward the target starting from the
standard draft's weights (on-policy, as DistillSpec warm-starts from the fine-tuned small model),
evaluates both drafts with the speculative decoder and prints the table. Each stage is a run
function (`train`, `evaluate`) configured under a scope (target/, draft/, distill/, evaluate/);
the caller supplies them through `stage`, so this module knows nothing of gin (the command line,
`distillspec.quickstart`, passes gin-configured ones).

The pretrained target and standard draft are cached across runs (`runs.model_cache`, keyed by
their configuration, the data and the training code): a second quickstart, or one that changes
only the distillation or the evaluation, reuses them; OUTPUT_DIR/target and OUTPUT_DIR/draft
link into the cache. Rerunning resumes every training stage from its checkpoints.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from distillspec.runs import model_cache

# stage(scope, run name) -> that run function, configured under the scope.
StageFn = Callable[[str, str], Callable[..., Any]]
# bindings(scope, run name) -> the arguments the stage's run function would receive.
BindingsFn = Callable[[str, str], dict[str, Any]]
PRETRAINED = ("target", "draft")  # The stages the cache serves.


def quickstart(
    output_dir: str = "runs/quickstart",
    cache_models: bool = True,
    model_cache_dir: str | None = None,
    *,
    stage: StageFn,
    bindings: BindingsFn | None = None,
) -> list[dict]:
    """Runs the pipeline under output_dir/{target,draft,distilled} and output_dir/records.jsonl.

    Args:
      output_dir: where the run's models, records and tables go.
      cache_models: pretrain the target and the standard draft into the model cache (or reuse
        them from it) and link them from output_dir; False trains them inside output_dir.
      model_cache_dir: the model cache (None: $DISTILLSPEC_CACHE/models, else
        ~/.cache/distillspec/models).
      stage: the stages' run functions (see StageFn).
      bindings: the stages' arguments, which key the cache (needed when cache_models).

    Returns:
      The evaluation records of this run (drafts labelled 'standard' and 'distilled').
    """
    target, draft = pretrained(output_dir, stage, bindings, cache_models, model_cache_dir)
    distilled = os.path.join(output_dir, "distilled")
    stage("distill", "train")(
        model_dir=distilled, teacher_checkpoint=target, student_checkpoint=draft
    )
    return stage("evaluate", "evaluate")(
        output_dir=output_dir,
        target_checkpoint=target,
        drafts={"standard": draft, "distilled": os.path.join(distilled, "export")},
    )


def pretrained(
    output_dir: str,
    stage: StageFn,
    bindings: BindingsFn | None,
    cache_models: bool = True,
    model_cache_dir: str | None = None,
    names: tuple[str, ...] = PRETRAINED,
) -> tuple[str, ...]:
    """Pretrains the target and the standard draft (stages target/ and draft/; or only the
    `names` among them) into output_dir/{target,draft}, through the model cache unless not
    `cache_models`, resuming an interrupted stage; returns their export directories."""
    path = lambda name: os.path.join(output_dir, name)
    for name in names:
        train = stage(name, "train")
        if not cache_models or (os.path.isdir(path(name)) and not os.path.islink(path(name))):
            train(model_dir=path(name))  # An earlier uncached run here resumes in place.
            continue
        if bindings is None:
            raise ValueError("cache_models needs the stages' bindings to key the cache")
        key = model_cache.fingerprint(bindings(name, "train"))
        cached = model_cache.cached_stage(name, key, train, model_cache_dir)
        model_cache.link(cached, path(name))
    return tuple(os.path.join(path(name), "export") for name in names)
