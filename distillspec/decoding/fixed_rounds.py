"""The decoder's own loop timing rounds: `decoding`'s program run for a set number of rounds.

`fixed_round_decoder` compiles the same `loop._decode` loop that `generate` and
`speculative_generate` run, with no row ever finishing and, for dynamic policies, the stopping
rule's verdict replaced by a given schedule of draft counts, so that the cost model
(`evaluation.timing.decoder_round_timers`) can time a program's own work per round, per draft
and per switch of verify width.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

import distillspec.decoding.lookahead as sl
from distillspec import checks
from distillspec.decoding.lookahead import Lookahead
from distillspec.decoding.loop import _decode, _Spec
from distillspec.decoding.sampling import SamplingConfig


def fixed_round_tokens(policy: Lookahead | None, drafts: Sequence[int] = (0,)) -> int:
    """The most tokens a row emits in a round of `fixed_round_decoder` (1 plain)."""
    if policy is None:
        return 1
    if policy.kind == "static":
        return policy.sl_max + 1
    held = 2 if policy.kind in (*sl.THRESHOLD_KINDS, "oracle") else policy.sl_max + 1
    return max(d + 1 if d else held for d in drafts)


def fixed_round_decoder(target, draft, policy: Lookahead | None, room: int, vocab_size=None,
                        schedule_length: int = 2, sampling=None):  # fmt: skip
    """The decoder (greedy unless `sampling`, a SamplingConfig, key 0; policy None and draft None:
    plain) timing rounds: fn(target_params, draft_params, prompt_tokens, prompt_lengths, num_rounds,
    classifier=None, drafts=(0,)) -> {'lengths', 'draft_calls', 'width_switches', 'sl_histogram'}
    per row; one program for any num_rounds and drafts. No row finishes (no EOS; num_rounds x
    `fixed_round_tokens` within room, the caches' room). Confidence, DISCO, the cumulative rule and
    the oracle are held to one draft call per round (a threshold no estimate passes, a reference no
    draft matches). drafts (dynamic policies; len dividing schedule_length): round r proposes
    drafts[r % len] drafts in [1, sl_max] (0: held). Only the stopping rule's verdict is replaced
    (its work still runs).
    """
    dynamic = policy is not None and policy.kind != "static"
    gamma = policy.sl_max if policy else 0
    vocab = checks.shared_vocab_size(target, draft, vocab_size)
    sampling = sampling or SamplingConfig()
    spec = _Spec(gamma, policy and policy.static_part, room, sampling, None, None, vocab)

    @jax.jit
    def program(target_params, draft_params, prompt_tokens, prompt_lengths, num_rounds,
                classifier, schedule):  # fmt: skip
        # Confidence / DISCO stop below 2, the cumulative rule above -1: after every draft.
        held = -1 if policy is not None and policy.kind == "cumulative" else 2
        inputs = {"threshold": jnp.float32(held), "start": jnp.int32(1), "classifier": classifier}
        if dynamic:
            inputs["drafts"] = schedule
        if policy is not None and policy.kind == "oracle":
            inputs["oracle_tokens"] = jnp.full((prompt_tokens.shape[0], room), -1, jnp.int32)
        out = _decode(target, draft, spec, target_params, draft_params, prompt_tokens,
                      prompt_lengths, None, inputs, num_rounds)  # fmt: skip
        return {k: out[k] for k in ("lengths", "draft_calls", "width_switches", "sl_histogram")}

    def run(target_params, draft_params, prompt_tokens, prompt_lengths, num_rounds,
            classifier=None, drafts=(0,)):  # fmt: skip
        drafts = tuple(drafts)
        ok = dynamic and schedule_length % len(drafts) == 0 and all(0 <= d <= gamma for d in drafts)
        if drafts != (0,) and not ok:
            raise ValueError(
                f"drafts must be (0,), or counts in [0, sl_max={gamma}] for a dynamic "
                f"policy, their number dividing {schedule_length}; got {drafts!r}"
            )
        if num_rounds * fixed_round_tokens(policy, drafts) > room:
            raise ValueError(f"{num_rounds} rounds of {drafts} drafts overrun room={room}")
        schedule = np.resize(np.asarray(drafts, np.int32), schedule_length)  # Tiled.
        return program(target_params, draft_params, prompt_tokens, prompt_lengths, num_rounds,
                       classifier, schedule)  # fmt: skip

    return run
