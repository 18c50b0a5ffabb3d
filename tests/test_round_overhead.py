"""The model-free check of a dynamic policy's rounds (`evaluation.policies.round_overhead_pct`):
its runs' rounds priced at the measured cost of static rounds of the same draft counts and
verify widths, from `DecodeResult.sl_histogram`. Nothing here is timed: the seconds are made up,
the counts come from decoding a tiny stub pair whose counts are known."""

from __future__ import annotations

import numpy as np
import pytest

from distillspec.decoding import Lookahead, generate, speculative_generate
from distillspec.evaluation.policies import (
    round_overhead_pct,
    static_priced_rounds_ms,
    static_round_ms,
)
from tests.test_utils import MarkovStub, markov_pair

VOCAB = 6
# Made-up call costs (ms), as `timing.call_costs` returns them.
COSTS = {
    "target": {w: 10.0 + w for w in range(1, 18)},
    "draft": {1: 0.5, 2: 0.75},
    "fixed": {"plain": 3.0, "static": 4.0},
}


def _fields(result, seconds: float, runs: int = 1) -> dict:
    """A policy's measured fields (`measure_policies`) of one decoding call, timed `seconds`."""
    return {
        "sl_histogram": [int(v) for v in result.sl_histogram.sum(0)],
        "draft_calls": int(result.draft_calls.sum()),
        "target_calls": int(result.target_calls.sum()),
        "prompt_seconds": [seconds],
        "runs": runs,
    }


def _decode(draft, policy, max_new_tokens):
    target, _ = markov_pair(VOCAB, 0, 0.0)
    prompt = (np.array([[1, 2, 3]], np.int32), np.array([3], np.int32))
    plain = generate(target, None, *prompt, max_new_tokens=max_new_tokens)
    out = speculative_generate(
        target, draft, None, None, *prompt, lookahead=policy, max_new_tokens=max_new_tokens,
        oracle_tokens=plain.tokens if policy.kind == "oracle" else None,
    )  # fmt: skip
    np.testing.assert_array_equal(out.tokens, plain.tokens)
    return out


def test_static_rounds_are_priced_from_the_static_runs():
    measured = {
        "target": {"prompt_seconds": [0.010, 0.014], "runs": 2, "target_calls": 12,
                   "sl_histogram": [0]},
        "static-2": {"prompt_seconds": [0.030], "runs": 1, "target_calls": 2,
                     "sl_histogram": [0, 0, 2]},
        "static-opt": {"prompt_seconds": [1.0], "runs": 1, "target_calls": 1,
                       "sl_histogram": [0, 0, 1]},
    }  # fmt: skip
    policies = {"static-2": Lookahead("static", 2), "static-opt": Lookahead("static", 2)}
    # (24 ms - 2 runs x 3 ms) / 12 steps; (30 ms - 4 ms) / 2 rounds; static-opt is not used.
    assert static_round_ms(measured, policies, COSTS) == pytest.approx({0: 1.5, 2: 13.0})


def test_a_draft_that_always_agrees_is_priced_at_full_static_rounds():
    """Draft = target: the oracle proposes every draft; 12 tokens at SL_max 4 are rounds of
    4, 4 and then 2 drafts (the reference ends), with one draft call past the last of them."""
    target, _ = markov_pair(VOCAB, 0, 0.0)
    out = _decode(MarkovStub(np.asarray(target.table), "same"), Lookahead("oracle", 4), 12)
    assert out.sl_histogram.tolist() == [[0, 0, 1, 0, 2]]
    assert int(out.draft_calls[0]) == 4 + 4 + 3
    round_ms = {0: 11.0, 2: 13.0, 4: 15.0}
    fields = _fields(out, seconds=0.0)
    priced = 13.0 + 2 * 15.0 + 1 * COSTS["draft"][1]  # The 3rd round's mismatching draft call.
    assert static_priced_rounds_ms(fields, Lookahead("oracle", 4), round_ms, COSTS) == priced
    fields["prompt_seconds"] = [(priced + COSTS["fixed"]["static"]) / 1e3]
    assert round_overhead_pct(fields, Lookahead("oracle", 4), round_ms, COSTS) == pytest.approx(0)
    fields["prompt_seconds"] = [(1.1 * priced + COSTS["fixed"]["static"]) / 1e3]
    assert round_overhead_pct(fields, Lookahead("oracle", 4), round_ms, COSTS) == pytest.approx(10)


def test_a_draft_that_never_agrees_is_priced_at_plain_steps_and_first_draft_calls():
    """A draft whose greedy token is never the target's: every oracle round proposes 0 drafts,
    a plain step plus the round's first (2-position) draft call."""
    target, _ = markov_pair(VOCAB, 0, 0.0)
    table = np.asarray(target.table)
    best = table.argmax(-1)
    wrong = np.where(np.arange(VOCAB) == ((best + 1) % VOCAB)[..., None], 100.0, 0.0)
    out = _decode(MarkovStub(wrong, "wrong"), Lookahead("oracle", 4), 7)
    assert out.sl_histogram.tolist() == [[7, 0, 0, 0, 0]]
    priced = 7 * (11.0 + COSTS["draft"][2])
    assert static_priced_rounds_ms(_fields(out, 0.0), Lookahead("oracle", 4), {0: 11.0},
                                   COSTS) == pytest.approx(priced)  # fmt: skip


def test_rounds_wider_than_the_widest_static_run_add_their_calls():
    """SL_max 16: a round of 12 drafts verifies at width 16 (`verify_widths`); with static runs
    up to SL-8 it costs SL-8's round plus 4 draft calls and the target's width 16 over 9."""
    fields = {"sl_histogram": [0] * 12 + [1] + [0] * 4, "draft_calls": 13}
    round_ms = {0: 11.0, 8: 20.0}
    priced = 20.0 + 4 * 0.5 + (10.0 + 16) - (10.0 + 9) + 1 * 0.5
    assert static_priced_rounds_ms(fields, Lookahead("oracle", 16), round_ms, COSTS) == priced
