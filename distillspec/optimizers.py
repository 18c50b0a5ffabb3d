"""The student's optimizer and learning-rate schedule (optax), configured by `OptimizerConfig`."""

from __future__ import annotations

import dataclasses

import optax

OPTIMIZERS = ("adafactor", "adamw")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """Optimizer and schedule; defaults after DistillSpec Table B.1 (scaled to short runs)."""

    name: str = "adafactor"  # 'adafactor' (the paper's) or 'adamw'.
    learning_rate: float = 3e-4  # Peak learning rate.
    warmup_steps: int = 0  # Linear warm-up from 0 to the peak.
    final_fraction: float = 0.1  # Cosine decay from the peak to final_fraction * peak.
    weight_decay: float = 0.0  # Decoupled weight decay (adamw only).
    clip_norm: float = 1.0  # Global gradient-norm clipping; 0 disables.

    def __post_init__(self):
        if self.name not in OPTIMIZERS:
            raise ValueError(f"OptimizerConfig.name must be one of {OPTIMIZERS}, got {self.name!r}")
        if not self.learning_rate > 0:
            raise ValueError(
                f"OptimizerConfig.learning_rate must be > 0, got {self.learning_rate!r}"
            )
        if self.warmup_steps < 0 or not 0 <= self.final_fraction <= 1 or self.clip_norm < 0:
            raise ValueError(
                "OptimizerConfig needs warmup_steps >= 0, final_fraction in [0, 1], clip_norm >= 0;"
                f" got {self.warmup_steps!r}, {self.final_fraction!r}, {self.clip_norm!r}"
            )


def make_schedule(config: OptimizerConfig, total_steps: int) -> optax.Schedule:
    """Linear warm-up to the peak, then cosine decay to final_fraction * peak at total_steps."""
    warmup = min(config.warmup_steps, max(total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0 if warmup else config.learning_rate,
        peak_value=config.learning_rate,
        warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1),
        end_value=config.learning_rate * config.final_fraction,
    )


def make_optimizer(config: OptimizerConfig, total_steps: int) -> optax.GradientTransformation:
    schedule = make_schedule(config, total_steps)
    if config.name == "adafactor":
        core = optax.adafactor(learning_rate=schedule, multiply_by_parameter_scale=False)
    else:
        core = optax.adamw(learning_rate=schedule, weight_decay=config.weight_decay)
    if config.clip_norm:
        return optax.chain(optax.clip_by_global_norm(config.clip_norm), core)
    return core
