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
    layer_loops,
    loop_copies,
    round_copies,
    round_overheads,
    round_timers,
)
from distillspec.decoding import speculative_program
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


def _program_text(pair, policy, max_new_tokens):
    model, target_params, draft, draft_params, prompt = pair
    oracle = np.zeros((1, max_new_tokens), np.int32) if policy.kind == "oracle" else None
    return speculative_program(
        model, draft, target_params, draft_params, *prompt, lookahead=policy,
        classifier=random_classifier(2) if policy.uses_classifier else None,
        oracle_tokens=oracle, max_new_tokens=max_new_tokens,
    ).as_text()  # fmt: skip


@pytest.mark.parametrize("kind", ["oracle", "disco"])
def test_a_dynamic_verify_is_the_static_rounds_target_call(pair, kind):
    """Issue 52 read the programs for what a dynamic round pays above a static round of its
    size: each verify-width branch runs the target's layer stack as the same instructions as
    the static SL-(w - 1) program's verify (caches of one length: the static runs get the
    dynamic one's sl_max - k more tokens), so no per-branch allocation, copy or layout change
    hides in a dynamic round's target call."""
    sl_max = 5
    dynamic = layer_loops(_program_text(pair, Lookahead(kind, sl_max), MAX_NEW), 3)
    for drafts in range(1, sl_max + 1):
        static = layer_loops(
            _program_text(pair, Lookahead("static", drafts), MAX_NEW + sl_max - drafts), 3
        )
        hidden = f"f32[1,{drafts + 1},24]"
        assert static[hidden] == dynamic[hidden], drafts


def test_layer_loops_finds_the_loops_of_a_known_trip_count():
    text = "\n".join([
        "%body.1 (p: (s32[], f32[1,2,8])) -> (s32[], f32[1,2,8]) {",
        "  %a.1 = f32[1,2,8]{2,1,0} add(%x, %y)",
        "  ROOT %t.1 = (s32[], f32[1,2,8]{2,1,0}) tuple(%i, %a.1)",
        "}",
        "ENTRY %main.2 (a: f32[1,2,8]) -> f32[1,2,8] {",
        '  %w.1 = (s32[], f32[1,2,8]{2,1,0}) while(%t), condition=%c.1, body=%body.1, '
        'backend_config={"known_trip_count":{"n":"3"}}',
        '  %w.2 = (s32[], f32[1,2,8]{2,1,0}) while(%t), condition=%c.1, body=%body.1, '
        'backend_config={"known_trip_count":{"n":"4"}}',
        "}",
    ])  # fmt: skip
    assert layer_loops(text, 3) == {"f32[1,2,8]": ["add f32[1,2,8]", "tuple (s32[], f32[1,2,8])"]}
