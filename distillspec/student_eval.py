"""Periodic evaluation of the student as a draft during distillation (`trainer.fit`)."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from distillspec.decoding import speculative_generate
from distillspec.decoding.sampling import SamplingConfig
from distillspec.feature_converters import decodable, valid_rows


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Periodic evaluation of the student as a draft during distillation (T5X's eval_period):
    every `period` steps (and before the first step and after the last), the speculative
    decoder runs the teacher as target and the current student as draft on `num_prompts`
    held-out prompts of `split`, and MODEL_DIR/metrics.jsonl and TensorBoard get `eval_alpha`
    (accepted / drafted) and `eval_tau` (tokens per target call) at that step, beside the
    training batches' 1 - TVD proxy (`acceptance_proxy`). The decoding key is fixed
    (PRNGKey(seed)), so successive figures differ only by the student."""

    period: int = 0  # Steps between evaluations; 0 = no periodic evaluation.
    num_prompts: int = 16  # Held-out prompts decoded per evaluation.
    gamma: int = 5  # Drafts per round.
    temperature: float = 1.0  # 0 = greedy.
    split: str = "validation"  # The training task's split the prompts come from.
    seed: int = 0  # The decoding key.

    def __post_init__(self):
        for name, minimum in (("period", 0), ("num_prompts", 1), ("gamma", 1), ("seed", 0)):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= minimum):
                raise ValueError(
                    f"EvalConfig.{name} must be an integer >= {minimum}, got {value!r}"
                )
        if not self.temperature >= 0:
            raise ValueError(f"EvalConfig.temperature must be >= 0, got {self.temperature!r}")

    @property
    def enabled(self) -> bool:
        return self.period > 0


def evaluate_student(models, params, prompts, config: EvalConfig, eos_id, max_new_tokens):
    """{'eval_alpha', 'eval_tau'} of the student drafting for the teacher over `prompts` (prompt
    batches; rows with valid=False are not counted)."""
    sums = np.zeros(4)  # accepted, drafted, generated tokens, target calls
    for i, batch in enumerate(prompts):
        rows = valid_rows(batch) > 0
        batch = decodable(batch)
        out = speculative_generate(
            models.teacher, models.student, models.teacher_params, params,
            batch["prompt_tokens"], batch["prompt_lengths"],
            jax.random.fold_in(jax.random.PRNGKey(config.seed), i), gamma=config.gamma,
            max_new_tokens=max_new_tokens, sampling=SamplingConfig(temperature=config.temperature),
            eos_id=eos_id,
        )  # fmt: skip
        fields = (out.accepted, out.drafted, out.lengths, out.target_calls)
        sums += [float(np.sum(np.asarray(f)[rows])) for f in fields]
    accepted, drafted, tokens, calls = sums
    return {"eval_alpha": accepted / max(drafted, 1.0), "eval_tau": tokens / max(calls, 1.0)}
