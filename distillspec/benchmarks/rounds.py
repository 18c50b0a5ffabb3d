"""Where a speculative round's time goes, per lookahead policy: read from the compiled programs
and timed.

    python -m distillspec.benchmarks.rounds --json OUT.json
    python -m distillspec.benchmarks.rounds --pair trained --draft distilled --json OUT.json

For static SL-k and every dynamic policy on `distillspec.benchmarks.disco`'s pairs (the same
pair flags), at batch 1:

  * `copies`, from XLA's optimized program of the decoder (`decoding.speculative_program`): the
    copies it makes inside its loop (outside the program's entry), how many megabytes they move
    at most, and those of a whole buffer of a KV cache's or a parameter's shape
    (tests/test_round_copies.py fails on one);
  * `round_ms`, `above_static_ms`: rounds of fixed sizes of each program (`round_timers`),
    timed interleaved: the same model calls as a static round, so a dynamic round minus the
    static one is its own work above static's (median, 90% interval over repeats); beside them
    the same dynamic programs with the cache written inside the width branches (the design
    before), unless --no_compare;
  * `round_overhead_pct`: per dynamic policy, its program's rounds in a mixed-width run (1 and
    --drafts drafts in turn, the verify width switching every round) against the mean of static
    SL-1's and SL-<drafts>'s rounds (median over repeats, %); `fixed_width_overhead_pct` the
    same for rounds of --drafts drafts only. `benchmarks.disco` reports the same check on real
    runs (their rounds priced from sl_histogram).
"""

from __future__ import annotations

import math
import re
import sys

import jax
import numpy as np

from distillspec.benchmarks import emit
from distillspec.decoding import speculative_program

_COMPUTATION = re.compile(r"^(ENTRY )?%?([\w.\-]+) .*\{$")
_COPY = re.compile(r"= (\w+)\[([\d,]*)\]\S* copy\(")
_BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "pred": 1, "s8": 1, "u8": 1}


def loop_copies(hlo_text: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """(computation, dtype, shape) of every `copy` in an optimized HLO module's text outside its
    ENTRY computation: the copies a decoding loop makes in its rounds (the entry's run once per
    call: a fresh cache's zeros, say)."""
    found, computation = [], None
    for line in hlo_text.splitlines():
        head = _COMPUTATION.match(line)
        if head and not line.startswith(" "):
            computation = None if head.group(1) else head.group(2)
        copy = _COPY.search(line)
        if copy and computation is not None:
            shape = tuple(int(n) for n in copy.group(2).split(",") if n)
            found.append((computation, copy.group(1), shape))
    return found


_WHILE = re.compile(r"= \(\S+, (\w+\[[\d,]*\]).* while\(.*body=%([\w.\-]+)")
_LAYOUT = re.compile(r"\{[^}]*\}")
_OP = re.compile(r"^\s*(?:ROOT )?%\S+ = (\(.*?\)|\S+) ([\w\-]+)\(")


def layer_loops(hlo_text: str, num_layers: int) -> dict[str, list[str]]:
    """{the loop's first carried array after its counter, e.g. 'f32[1,6,256]' (a call's hidden
    states: its width): the body's instructions as 'opcode shape' (layouts and names dropped)}
    of every while loop of an optimized HLO module that XLA knows runs num_layers times: a
    scanned layer stack's, one per model call a program compiles. A dynamic round's verify at
    width w compiled as a static round's of that width has the same list."""
    bodies, name, lines = {}, None, []
    for line in hlo_text.splitlines():
        head = _COMPUTATION.match(line)
        if head and not line.startswith(" "):
            name, lines = head.group(2), []
            bodies[name] = lines
        elif name is not None:
            op = _OP.match(line)
            if op:
                lines.append(op.group(2) + " " + _LAYOUT.sub("", op.group(1)))
    loops = {}
    for line in hlo_text.splitlines():
        loop = _WHILE.search(line)
        if loop and f'"known_trip_count":{{"n":"{num_layers}"}}' in line:
            loops[loop.group(1)] = bodies[loop.group(2)]
    return loops


def copy_megabytes(copies) -> float:
    """Megabytes the copies move (an upper bound per round: a branch's run only when taken)."""
    return sum(math.prod(s) * _BYTES.get(t, 4) for _, t, s in copies) / 1e6


def buffer_shapes(tree) -> set[tuple[int, ...]]:
    """Shapes of a pytree's arrays of two or more dimensions (a cache's, the parameters')."""
    return {tuple(x.shape) for x in jax.tree.leaves(tree) if len(x.shape) >= 2}


def cache_copies(hlo_text: str, shapes: set[tuple[int, ...]]) -> list[tuple[str, str, tuple]]:
    """`loop_copies` of a whole buffer of one of these shapes (a KV cache's, the parameters')."""
    return [c for c in loop_copies(hlo_text) if c[2] in shapes]


def decoder_buffers(target, target_params, draft, draft_params, prompt, sl_max: int,
                    max_new_tokens: int) -> dict[str, set]:  # fmt: skip
    """{'target cache', 'draft cache', 'target params', 'draft params': shapes} of a
    speculative decoding run of this prompt ([1, P], [1]) with sl_max drafts at most."""
    tokens, lengths = prompt
    length = tokens.shape[1] + max_new_tokens + sl_max + 1  # As `decoding.loop._decode` sizes it.
    out = {}
    for name, model, params in (("target", target, target_params), ("draft", draft, draft_params)):
        cache = jax.eval_shape(lambda p, m=model: m.prefill(p, tokens, lengths, length)[0], params)
        out[f"{name} cache"] = buffer_shapes(cache)
        out[f"{name} params"] = buffer_shapes(params)
    return out


def round_copies(target, target_params, draft, draft_params, prompt, policy, *,
                 max_new_tokens: int, classifier=None, eos_id=None) -> dict:  # fmt: skip
    """What the compiled program of `speculative_generate(lookahead=policy)` copies in its
    loop: {'count', 'megabytes', and per buffer kind (`decoder_buffers`) its copies}."""
    oracle = None
    if policy.kind == "oracle":
        oracle = np.zeros((prompt[0].shape[0], max_new_tokens), np.int32)
    text = speculative_program(
        target, draft, target_params, draft_params, *prompt, lookahead=policy,
        classifier=classifier if policy.uses_classifier else None, oracle_tokens=oracle,
        max_new_tokens=max_new_tokens, eos_id=eos_id,
    ).as_text()  # fmt: skip
    copies = loop_copies(text)
    buffers = decoder_buffers(target, target_params, draft, draft_params, prompt, policy.sl_max,
                              max_new_tokens)  # fmt: skip
    out = {"count": len(copies), "megabytes": round(copy_megabytes(copies), 3)}
    for name, shapes in buffers.items():
        out[name] = [f"{t}{list(s)}" for _, t, s in copies if s in shapes]
    return out


class WritingInBranches:
    """A model seen without its optional `extend_entries`: the decoder's verify-width branches
    then write its cache themselves, as every dynamic round did before (the A side of --compare;
    the path of a model that lacks the pair)."""

    def __init__(self, model):
        self.model, self.vocab_size = model, model.vocab_size
        self.encoder_decoder = model.encoder_decoder

    def prefill(self, params, prompt_tokens, prompt_lengths, cache_length):
        return self.model.prefill(params, prompt_tokens, prompt_lengths, cache_length)

    def extend(self, params, cache, tokens, positions):
        return self.model.extend(params, cache, tokens, positions)


def round_timers(target, target_params, draft, draft_params, prompt, policies, drafts: int, *,
                 max_new_tokens: int, classifier=None, compare: bool = True,
                 static_widths: bool = False) -> dict:  # fmt: skip
    """{name: timer of (seconds per round, seconds outside the rounds)} of the decoder's own
    loop (`timing.decoder_round_timers`) in rounds of fixed sizes, so that every program makes
    the same model calls: 'static-<d>' and 'static-1' (their own rounds; with static_widths
    every static-<k> up to the largest SL_max of policies, at most 8: what a round costs by
    its verify width, k + 1), and per dynamic
    policy '<name>' (rounds of `drafts` drafts), '<name>/1,<d>' (1 and `drafts` in turn: a
    width switch every round), and with compare the same two on `WritingInBranches(target)`
    ('<name>/writing', '<name>/1,<d>/writing'). A dynamic round minus static-<d>'s (or the
    mean of static-1 and static-<d> for the alternating one) is its own work above static's."""
    from distillspec.decoding.lookahead import Lookahead
    from distillspec.evaluation.timing import decoder_round_timers

    tokens, lengths = prompt
    timers = {}
    widest = min(max(p.sl_max for p in policies.values()), 8) if static_widths else drafts
    for k in sorted({1, drafts} | (set(range(1, widest + 1)) if static_widths else set())):
        static = Lookahead("static", k)
        timed = decoder_round_timers(target, target_params, draft, draft_params, tokens, lengths,
                                     static, max_new_tokens)  # fmt: skip
        timers[f"static-{k}"] = timed[0][0]
    targets = {"": target, "/writing": WritingInBranches(target)} if compare else {"": target}
    for name, policy in policies.items():
        if policy.kind == "static":
            continue
        use = classifier if policy.uses_classifier else None
        for suffix, model in targets.items():
            timed = decoder_round_timers(
                model, target_params, draft, draft_params, tokens, lengths, policy.static_part,
                max_new_tokens, use, ((drafts,), (1, drafts)),
            )  # fmt: skip
            timers[name + suffix] = timed[0][0]
            timers[f"{name}/1,{drafts}{suffix}"] = timed[1][0]
    return timers


def round_overheads(per_round: dict[str, np.ndarray], dynamic, drafts: int) -> dict:
    """{'round_overhead_pct': {policy: %}, 'fixed_width_overhead_pct': {policy: %}} from ms per
    round per repeat (`round_timers`' names): the median over repeats of a dynamic program's
    round over the static rounds of the same sizes, - 1: its rounds of 1 and `drafts` drafts in
    turn ('<name>/1,<drafts>', a width switch every round) over the mean of static-1's and
    static-<drafts>'s, and its rounds of `drafts` drafts ('<name>') over static-<drafts>'s."""
    one, full = per_round["static-1"], per_round[f"static-{drafts}"]
    pct = lambda rounds, base: round(float(np.median(100.0 * (rounds / base - 1.0))), 2)
    return {
        "round_overhead_pct": {
            n: pct(per_round[f"{n}/1,{drafts}"], (one + full) / 2) for n in dynamic
        },
        "fixed_width_overhead_pct": {n: pct(per_round[n], full) for n in dynamic},
    }


def build_parser():
    """disco's command line (the pair: --pair, --draft, --run_dir, --target_mb ...) plus this
    benchmark's own flags (tests/test_docs.py checks the docs against it)."""
    from distillspec.benchmarks.disco import build_parser as disco_parser

    parser = disco_parser()
    parser.description = __doc__.split("\n")[0]
    parser.add_argument("--sl_max", type=int, default=8, help="every dynamic policy's SL_max")
    parser.add_argument("--drafts", type=int, default=4, help="drafts per timed round")
    parser.add_argument("--round_repeats", type=int, default=15, help="interleaved timings")
    parser.add_argument(
        "--no_static_widths", action="store_true",
        help="skip timing static rounds of every size (what a round costs by verify width)",
    )  # fmt: skip
    parser.add_argument(
        "--no_compare", action="store_true",
        help="skip the dynamic programs with the cache written in the branches",
    )  # fmt: skip
    return parser


def main(argv=None) -> dict:
    from distillspec.benchmarks.disco import _pair_and_prompts
    from distillspec.decoding.lookahead import Lookahead, StopClassifier, num_features
    from distillspec.evaluation.timing import interleaved, repeats_interval

    args = build_parser().parse_args(argv)
    if not 1 <= args.drafts <= min(args.sl_max, 8):
        raise SystemExit(f"--drafts must be in [1, min(--sl_max, 8)], got {args.drafts}")
    args.train_prompts = args.validation_prompts = 0
    args.test_prompts = 1
    pair, prompts, eos_id = _pair_and_prompts(args)
    target, target_params, draft, draft_params, description = pair
    prompt = prompts["test"][0]
    # A classifier's work does not depend on its weights, nor on its verdicts here: the timed
    # rounds are of fixed sizes.
    classifier = StopClassifier().init(jax.random.PRNGKey(0), np.zeros((1, num_features(8))))
    policies = {kind: Lookahead(kind, args.sl_max) for kind in
                ("heuristic", "confidence", "disco", "cumulative", "oracle")}  # fmt: skip
    policies = {"static": Lookahead("static", args.drafts), **policies}
    common = dict(max_new_tokens=args.max_new_tokens)
    models = (target, target_params, draft, draft_params, prompt)
    print("[rounds] reading the compiled programs ...", file=sys.stderr, flush=True)
    copies = {
        name: round_copies(*models, p, classifier=classifier, eos_id=eos_id, **common)
        for name, p in policies.items()
    }
    print("[rounds] compiling the timed loops ...", file=sys.stderr, flush=True)
    timers = round_timers(*models, policies, args.drafts, classifier=classifier,
                          compare=not args.no_compare,
                          static_widths=not args.no_static_widths, **common)  # fmt: skip
    interleaved(timers, 1)  # The first runs after compiling are slow.
    results, _ = interleaved(timers, args.round_repeats)
    per_round = {name: np.array([r[0] for r in runs]) * 1e3 for name, runs in results.items()}
    d = args.drafts
    static = {"": per_round[f"static-{d}"],
              f"/1,{d}": (per_round["static-1"] + per_round[f"static-{d}"]) / 2}  # fmt: skip

    def above_static(name):  # Median over repeats of (a round - static's) and its 90% interval.
        base = static[f"/1,{d}"] if f"/1,{d}" in name else static[""]
        diff = per_round[name] - base
        low, high = repeats_interval(lambda i: [np.median(diff[i])], len(diff))
        return [round(float(np.median(diff)), 3), round(float(low[0]), 3), round(float(high[0]), 3)]

    dynamic = [n for n in policies if n != "static"]
    result = {
        "pair": description,
        "backend": jax.default_backend(),
        "sl_max": args.sl_max,
        "drafts": d,
        "round_ms": {n: round(float(np.median(v)), 3) for n, v in per_round.items()},
        "above_static_ms": {n: above_static(n) for n in per_round if not n.startswith("static")},
        # A mixed-width run (1 and --drafts drafts in turn: the verify width switches every
        # round) against the static rounds of the same sizes; and rounds of one width.
        **round_overheads(per_round, dynamic, d),
        # A static round of k drafts over one of 1 draft: how a round's cost grows with its
        # verify width (k + 1) and drafts, in the decoder's own loop.
        "static_round_ratio": {
            n: round(float(np.median(v / per_round["static-1"])), 3)
            for n, v in per_round.items()
            if n.startswith("static-")
        },
        "copies": copies,
    }
    return emit(result, args.json)


if __name__ == "__main__":
    main()
