"""What one draw from a [1, V] distribution costs inside a jitted loop: Gumbel-max against the
decoder's sampler (`sampling.sample_categorical`, the inverse of the running sum) and argmax.

    python -m distillspec.benchmarks.sampler_cost [--vocab 2048] [--repeats 9] [--steps 200]

Prints one JSON object: microseconds per draw for each (medians of the difference of a long and
a one-step loop, so dispatch cancels out; compilation excluded) and gumbel_over_sampler.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp

from distillspec.decoding.sampling import sample_categorical

DRAWS = {
    "gumbel_max": lambda rng, p: jax.random.categorical(rng, jnp.log(p), axis=-1),
    "sampler": sample_categorical,
    "argmax": lambda rng, p: jnp.argmax(p, axis=-1),
}


def microseconds_per_draw(draw, probs, repeats: int, steps: int = 200) -> float:
    @jax.jit
    def run(probs, n):
        def body(i, total):  # Each step's input depends on the last draw, as in decoding.
            rng = jax.random.fold_in(jax.random.PRNGKey(0), i)
            return total + draw(rng, probs + 1e-9 * total[0]).astype(jnp.int32)

        return jax.lax.fori_loop(0, n, body, jnp.zeros((1,), jnp.int32))

    def timed(n):
        start = time.perf_counter()
        run(probs, n).block_until_ready()
        return time.perf_counter() - start

    timed(steps), timed(1)  # Compiles.
    return statistics.median(1e6 * (timed(steps) - timed(1)) / (steps - 1) for _ in range(repeats))


def build_parser() -> argparse.ArgumentParser:
    """The command line (tests/test_docs.py checks the docs' flags against it)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--steps", type=int, default=200, help="draws in the long loop (>= 2)")
    return parser


def main(argv=None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error(f"--steps must be >= 2, got {args.steps}")
    probs = jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(1), (1, args.vocab)))
    result = {f"{name}_us": round(microseconds_per_draw(draw, probs, args.repeats, args.steps), 2)
              for name, draw in DRAWS.items()}  # fmt: skip
    result["gumbel_over_sampler"] = round(result["gumbel_max_us"] / result["sampler_us"], 2)
    result.update(vocab=args.vocab, backend=jax.default_backend())
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
