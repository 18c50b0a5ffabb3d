"""What the weight checks of every load cost against the load itself, in one process.

    python scripts/load_check_cost.py [--embed_dim 512] [--num_layers 8] [--vocab_size 32000] \\
        [--repeats 7] [--json OUT.json]

Exports a random Llama-style model (float32, `models.save_pretrained`) to a temporary
directory and times `models.load_checkpoint` on it with the checks (`models.weight_checks`:
every tensor's values finite, each file's header whole) and without them (the finite check
replaced by the identity), interleaved, one call of each per repeat after one untimed call each
(the file then lies in the page cache for both); medians in ms:
  load_ms            the load as every run does it (checks on);
  load_unchecked_ms  the same load with the finite check off;
  overhead           load_ms / load_unchecked_ms - 1 (the goal: under 5%);
  serve_check_ms     `serving.check` of the export on its own (headers, shapes, values).
Compare the figures only as ratios measured in one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import jax
import numpy as np

from distillspec import serving
from distillspec.models import (
    DecoderOnlyLM,
    TransformerConfig,
    load_checkpoint,
    safetensors_files,
    save_pretrained,
)


def _timed(fn) -> float:
    start = time.perf_counter()
    out = fn()
    jax.block_until_ready(out)
    return (time.perf_counter() - start) * 1e3


def measure(embed_dim: int, num_layers: int, vocab_size: int, repeats: int) -> dict:
    config = TransformerConfig(
        vocab_size=vocab_size, embed_dim=embed_dim, num_layers=num_layers, num_heads=8,
        num_kv_heads=8, head_dim=embed_dim // 8, mlp_dim=4 * embed_dim,
    )  # fmt: skip
    model = DecoderOnlyLM(config)
    params = model.init(jax.random.PRNGKey(0))
    size = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    checked = safetensors_files.check_finite
    with tempfile.TemporaryDirectory() as directory:
        save_pretrained(model, params, directory)
        del params

        def load(check: bool):
            safetensors_files.check_finite = checked if check else (lambda value, *_: value)
            try:
                return load_checkpoint(directory)[1]
            finally:
                safetensors_files.check_finite = checked

        times = {True: [], False: []}
        for check in (True, False):
            _timed(lambda c=check: load(c))  # Untimed: page cache and compilation warm.
        for _ in range(repeats):
            for check in (True, False):
                times[check].append(_timed(lambda c=check: load(c)))
        serve = [_timed(lambda: serving.check(directory, None)) for _ in range(3)]
    on, off = statistics.median(times[True]), statistics.median(times[False])
    return {
        "params": size, "bytes": 4 * size, "repeats": repeats, "load_ms": round(on, 1),
        "load_unchecked_ms": round(off, 1), "overhead": round(on / off - 1, 4),
        "serve_check_ms": round(statistics.median(serve), 1),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(prog="python scripts/load_check_cost.py")
    parser.add_argument("--embed_dim", type=int, default=512)
    parser.add_argument("--num_layers", type=int, default=8)
    parser.add_argument("--vocab_size", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args()
    result = measure(args.embed_dim, args.num_layers, args.vocab_size, args.repeats)
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
