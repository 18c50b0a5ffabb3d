"""The decoder: plain and speculative decoding in one jitted loop, exact in lossless mode.

  loop.py          the loop: prefill, rounds (drafts, one target verify call, acceptance,
                   bookkeeping) until every row is done; `generate`, `speculative_generate`.
  acceptance.py    the verification rule: greedy match, or accept / resample (exact in
                   distribution), with lenience functions for lossy decoding.
  lookahead.py     how many drafts a round proposes: static, heuristic, confidence, DISCO's
                   classifier, the cumulative rule, the oracle.
  sampling.py      logits to processed distributions (temperature, top-k, top-p) and draws.
  fixed_rounds.py  the same loop run for a set number of rounds: the cost model's timers.
  result.py        `DecodeResult` and the packing of a call's outputs for the host.

The public API is re-exported here: `from distillspec.decoding import generate,
speculative_generate, Lookahead, SamplingConfig`. docs/decoding.md explains the loop.
"""

from distillspec.decoding.acceptance import Lenience
from distillspec.decoding.lookahead import Lookahead, StopClassifier
from distillspec.decoding.loop import (
    generate,
    generate_on_device,
    speculative_generate,
    speculative_program,
)
from distillspec.decoding.result import DecodeResult
from distillspec.decoding.sampling import SamplingConfig

__all__ = [
    "DecodeResult",
    "Lenience",
    "Lookahead",
    "SamplingConfig",
    "StopClassifier",
    "generate",
    "generate_on_device",
    "speculative_generate",
    "speculative_program",
]
