"""No round of the decoder copies a KV cache or the parameters (read from XLA's optimized
program): a dynamic round once copied the whole target cache, because its verify-width
`lax.switch` updated the cache inside each branch."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from distillspec.benchmarks.rounds import (
    WritingInBranches,
    cache_copies,
    decoder_buffers,
    loop_copies,
    round_copies,
    round_overheads,
    round_timers,
)
from distillspec.decoding.lookahead import KINDS, Lookahead
from distillspec.models import DecoderOnlyLM, TransformerConfig
from tests.test_lookahead import random_classifier

MAX_NEW = 12


@pytest.fixture(scope="module")
def pair():
    """A small multi-layer pair (3 and 2 blocks; shapes no other buffer has) and a prompt."""
    target = DecoderOnlyLM(TransformerConfig(vocab_size=48, embed_dim=24, num_layers=3,
                                             num_heads=2, num_kv_heads=1, head_dim=12,
                                             mlp_dim=40))  # fmt: skip
    draft = DecoderOnlyLM(TransformerConfig(vocab_size=48, embed_dim=16, num_layers=2,
                                            num_heads=2, num_kv_heads=2, head_dim=8,
                                            mlp_dim=20))  # fmt: skip
    prompt = (np.arange(1, 8, dtype=np.int32)[None], np.array([7], np.int32))
    params = target.init(jax.random.PRNGKey(0)), draft.init(jax.random.PRNGKey(1))
    return target, params[0], draft, params[1], prompt


def _copies(pair, policy, target=None):
    model, target_params, draft, draft_params, prompt = pair
    return round_copies(target or model, target_params, draft, draft_params, prompt, policy,
                        max_new_tokens=MAX_NEW, classifier=random_classifier(2))  # fmt: skip


@pytest.mark.parametrize("kind", KINDS)
def test_no_round_copies_a_cache_or_the_parameters(pair, kind):
    copies = _copies(pair, Lookahead(kind, 5))
    for buffer in ("target cache", "draft cache", "target params", "draft params"):
        assert copies[buffer] == [], (kind, buffer, copies)


def test_the_check_finds_a_round_that_copies_the_cache(pair):
    """The same dynamic round with the cache written inside the width branches copies it; a
    static round (no branches) does not."""
    writing = WritingInBranches(pair[0])  # The planted variant: the branches write the cache.
    copies = _copies(pair, Lookahead("disco", 5), target=writing)
    assert copies["target cache"], copies
    assert _copies(pair, Lookahead("static", 5), target=writing)["target cache"] == []


def test_loop_copies_reads_computations_outside_the_entry():
    text = "\n".join([
        "%body.1 (p: f32[2,3]) -> f32[2,3] {",
        "  %copy.1 = f32[2,3]{1,0} copy(%p)",
        "  %copy.2 = bf16[4]{0} copy(%q)",
        "}",
        "ENTRY %main.2 (a: f32[2,3]) -> f32[2,3] {",
        "  %copy.3 = f32[2,3]{1,0} copy(%a)",
        "}",
    ])  # fmt: skip
    assert loop_copies(text) == [("body.1", "f32", (2, 3)), ("body.1", "bf16", (4,))]
    assert cache_copies(text, {(2, 3)}) == [("body.1", "f32", (2, 3))]


def test_decoder_buffers_are_the_caches_and_parameters(pair):
    model, target_params, draft, draft_params, prompt = pair
    shapes = decoder_buffers(model, target_params, draft, draft_params, prompt, 5, MAX_NEW)
    assert shapes["target cache"] == {(3, 1, 7 + MAX_NEW + 6, 1, 12)}
    assert shapes["draft cache"] == {(2, 1, 7 + MAX_NEW + 6, 2, 8)}
    assert (3, 24, 40) in shapes["target params"]  # The stacked MLP kernels.


def test_round_timers_time_static_and_both_verify_paths(pair):
    model, target_params, draft, draft_params, prompt = pair
    policies = {"static": Lookahead("static", 3), "disco": Lookahead("disco", 5)}
    timers = round_timers(model, target_params, draft, draft_params, prompt, policies, 3,
                          max_new_tokens=MAX_NEW, classifier=random_classifier(2))  # fmt: skip
    assert set(timers) == {"static-1", "static-3", "disco", "disco/1,3", "disco/writing",
                           "disco/1,3/writing"}  # fmt: skip
    for name, timer in timers.items():  # (A tiny round's time can come out <= 0 under load.)
        per_round, outside = timer()
        assert np.isfinite(per_round) and outside >= 0, name


def test_round_overheads_compare_each_round_with_static_rounds_of_its_sizes():
    """Per repeat: the 1,4 run's round against the mean of SL-1's and SL-4's, the 4-draft
    run's against SL-4's; the median over repeats, in percent."""
    per_round = {
        "static-1": np.array([10.0, 10.0, 12.0]),
        "static-4": np.array([14.0, 14.0, 16.0]),
        "oracle": np.array([14.0, 14.7, 16.0]),
        "oracle/1,4": np.array([13.2, 12.0, 14.0]),
    }
    out = round_overheads(per_round, ["oracle"], 4)
    assert out["round_overhead_pct"] == {"oracle": 0.0}  # +10%, 0%, 0%.
    assert out["fixed_width_overhead_pct"] == {"oracle": 0.0}  # 0%, +5%, 0%.
    per_round["oracle/1,4"] = per_round["oracle/1,4"] * 1.1
    assert out != round_overheads(per_round, ["oracle"], 4)
    assert round_overheads(per_round, ["oracle"], 4)["round_overhead_pct"]["oracle"] == 10.0
