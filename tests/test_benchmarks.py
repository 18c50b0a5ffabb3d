"""The speculative benchmark's measurement on a tiny pair (the reference pair is too big for
tests) and its --dtype option."""

from __future__ import annotations

import pytest

from distillspec.benchmarks import speculative as bench
from tests.test_utils import perturbed, tiny_lm


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_measure_reports_its_dtype_and_stays_exact(dtype):
    model, params = tiny_lm(32)
    pair = bench.in_dtype((model, params, model, perturbed(params, 0.05, seed=1), "tiny"), dtype)
    record = bench.measure(pair, gamma=2, batch=1, max_new_tokens=8, prompt_len=4, repeats=1)
    assert record["dtype"] == dtype
    assert record["exact_greedy"] and record["speedup"] > 0


def test_bad_dtype_names_the_value_and_the_valid_ones(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--dtype", "float32", "fp16"])
    err = capsys.readouterr().err
    assert "--dtype" in err and "'fp16'" in err and "('float32', 'bfloat16')" in err
