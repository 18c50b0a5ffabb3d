"""The main job's qualitative result holds for two seeds, at a reduced size.

configs/tests/reduced_quickstart.gin is the quickstart's recipe (stdlib source text for
pretraining, the stdlib code task, the embedded vocabulary, on-policy distillation) with smaller
models, shorter sequences and fewer steps; its target's seed is pinned, so the second seed
reuses it from the model cache and SEED varies the draft's training and the sampling. For each
seed, the distilled draft's tau must exceed the standard
draft's by more than the spread over prompts (the two 95% half-widths combined), at gamma 5
and T = 0 and 1; and the gain must be larger than its spread over the two seeds.
"""

from __future__ import annotations

import math

import gin
import pytest

from distillspec import quickstart
from tests.test_utils import TEST_CONFIGS

CONFIG = TEST_CONFIGS / "reduced_quickstart.gin"
SEEDS = (0, 1)


@pytest.fixture(scope="module")
def seed_records(tmp_path_factory):
    cache = tmp_path_factory.mktemp("models")
    runs = {}
    for seed in SEEDS:
        gin.clear_config()
        out = tmp_path_factory.mktemp(f"reduced{seed}")
        runs[seed] = quickstart.main(
            [f"--output_dir={out}", f"--gin_file={CONFIG}", f"--gin.SEED={seed}",
             f"--gin.quickstart.model_cache_dir='{cache}'"]
        )  # fmt: skip
        gin.clear_config()
    return runs


def _tau(records, draft, temperature):
    (r,) = [r for r in records if (r["draft"], r["temperature"]) == (draft, temperature)]
    assert r["gamma"] == 5
    return r["tau"], r["tau_ci95"]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_distilled_beats_standard_by_more_than_the_spread(seed_records, temperature):
    gains = []
    for seed, records in seed_records.items():
        standard, standard_ci = _tau(records, "standard", temperature)
        distilled, distilled_ci = _tau(records, "distilled", temperature)
        spread = math.hypot(standard_ci, distilled_ci)
        assert distilled - standard > spread, (seed, temperature, standard, distilled, spread)
        gains.append(distilled - standard)
    assert abs(gains[0] - gains[1]) < min(gains), gains  # Seeds agree more than they differ.
