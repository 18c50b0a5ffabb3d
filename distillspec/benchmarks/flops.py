"""The models' matmul FLOPs per training-step part, and the ideal time they take at a measured
matmul rate (`python -m distillspec.benchmarks.train_step`'s `*_ideal_ms`, `*_utilisation`).

Counted as the decoder-only model (`distillspec.models.TransformerConfig`) computes them: every
product 2 m k n FLOPs; per position and layer the q, k, v, o projections and the feed-forward
block's two (three if gated) products, per position that needs logits the lm head (in a
distillation step only the completion's: `loss_positions`), and attention's two products
(scores and the weighted values) over every key the model computes, masked ones included (all T
positions in teacher forcing, the whole cache when decoding). Embedding lookups, norms,
softmaxes, the loss and the optimizer are not matmuls and count 0: they are what a part spends
above its ideal. A backward pass is 2x its forward (the gradients of each product's two
operands), so a training step is 3x a forward.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from typing import Any

# The rate's reference product, [M, K] x [K, N] in float32: the shape of a hidden layer's
# product at 4096 positions (the issue that asked for the figures measured this one).
MATMUL_SHAPE = (4096, 256, 1024)


def product_flops(m: int, k: int, n: int) -> int:
    """FLOPs of an [m, k] x [k, n] product (a multiply and an add per term)."""
    return 2 * m * k * n


def forward_flops(
    config: Any, rows: int, tokens: int, keys: int, head_tokens: int | None = None
) -> int | None:
    """Matmul FLOPs of a forward pass over rows x tokens positions, each attending over `keys`
    keys, with the lm head on rows x head_tokens of them (default all); None for a model that
    is not decoder-only (no formula here)."""
    if not hasattr(config, "num_kv_heads") or not hasattr(config, "gated_mlp"):
        return None
    e, h, kv, d = config.embed_dim, config.num_heads, config.num_kv_heads, config.head_dim
    projections = product_flops(1, e, (h + 2 * kv) * d) + product_flops(1, h * d, e)
    mlp = (3 if config.gated_mlp else 2) * product_flops(1, e, config.mlp_dim)
    attention = 2 * product_flops(1, d, keys) * h  # q.k over the keys, then probs.v.
    per_position = config.num_layers * (projections + mlp + attention)
    head = product_flops(1, e, config.vocab_size)
    return rows * (tokens * per_position + (tokens if head_tokens is None else head_tokens) * head)


def sampling_flops(config: Any, rows: int, prompt_length: int, new_tokens: int) -> int | None:
    """Matmul FLOPs of sampling `new_tokens` per row after a padded prompt, as
    `decoding.generate` runs it: a prefill of the prompt into a cache of S = P + N + 1 slots
    (each prompt position attending over the cache and the prompt), then N one-token steps
    (each over the cache and itself); every row samples all N (EOS only shortens rows whose
    loop is not the batch's longest)."""
    slots = prompt_length + new_tokens + 1
    prefill = forward_flops(config, rows, prompt_length, slots + prompt_length)
    steps = forward_flops(config, rows, new_tokens, slots + 1)
    return None if prefill is None else prefill + steps


def part_flops(
    teacher: Any, student: Any, rows: int, prompt_length: int, new_tokens: int,
    pretrain_rows: int, pretrain_length: int,
) -> dict[str, int | None]:  # fmt: skip
    """{part: matmul FLOPs} for the train-step benchmark's parts, on a packed decoder-only batch
    of rows x (prompt_length + new_tokens) positions (the heads on the new_tokens loss positions):
    the teacher's forward, the student's sampling, the student's forward and backward, the whole
    on-policy step (their sum), and the teacher's pretraining step on pretrain_rows x
    pretrain_length positions (every one weighted)."""
    length = prompt_length + new_tokens
    teacher_forward = forward_flops(teacher, rows, length, length, new_tokens)
    student_forward = forward_flops(student, rows, length, length, new_tokens)
    pretrain_forward = forward_flops(teacher, pretrain_rows, pretrain_length, pretrain_length)
    flops = {
        "teacher_forward": teacher_forward,
        "sampling": sampling_flops(student, rows, prompt_length, new_tokens),
        "student_fwd_bwd": None if student_forward is None else 3 * student_forward,
        "pretrain_step": None if pretrain_forward is None else 3 * pretrain_forward,
    }
    parts = [flops[k] for k in ("teacher_forward", "sampling", "student_fwd_bwd")]
    flops["kd_step_onpolicy"] = None if None in parts else sum(parts)
    return flops


def utilisation(flops: dict[str, int | None], ms: dict[str, float], gflops: float) -> dict:
    """Per part: `{part}_gflop`, `{part}_ideal_ms` (its matmul FLOPs at `gflops` GFLOP/s) and
    `{part}_utilisation` (ideal / measured `{part}_ms`); None where no formula applies."""
    record = {}
    for part, count in flops.items():
        ideal = None if count is None else 1e3 * count / (gflops * 1e9)
        record[f"{part}_gflop"] = None if count is None else round(count / 1e9, 6)
        record[f"{part}_ideal_ms"] = None if ideal is None else round(ideal, 4)
        measured = ms[f"{part}_ms"]
        record[f"{part}_utilisation"] = None if ideal is None else round(ideal / measured, 4)
    return record


@dataclasses.dataclass(frozen=True)
class Product:
    """One of a compiled program's dot products: operand shapes, dtypes and dimension numbers
    (as `jax.lax.dot_general` takes them), and how many times the program has it."""

    lhs: tuple[int, ...]
    rhs: tuple[int, ...]
    dtypes: tuple[str, str]
    dimension_numbers: tuple  # ((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch))
    count: int = 1

    @property
    def flops(self) -> int:
        """2 x (output elements) x (contracted length), per occurrence."""
        (lhs_contracting, rhs_contracting), (lhs_batch, _) = self.dimension_numbers
        contracted = math.prod(self.lhs[i] for i in lhs_contracting)
        lhs_free = math.prod(n for i, n in enumerate(self.lhs)
                             if i not in lhs_contracting and i not in lhs_batch)  # fmt: skip
        rhs_free = math.prod(self.rhs) // math.prod(self.rhs[i] for i in rhs_contracting)
        return 2 * lhs_free * contracted * rhs_free  # rhs_free includes the batch dimensions.


_HLO_VALUE = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\w+)\[([\d,]*)\]")
_HLO_DOT = re.compile(r"\bdot\(([^)]*)\)")
_HLO_DIMS = re.compile(r"\b((?:lhs|rhs)_(?:contracting|batch)_dims)=\{([\d,]*)\}")


_HLO_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) ")
_HLO_NAME = re.compile(r"%([\w.\-]+)")
_HLO_WHILE = re.compile(r"\swhile\(")
_HLO_BODY = re.compile(r"\bbody=%([\w.\-]+)")


def _looped_products(hlo: str) -> bool:
    """Whether a loop's body of the program (or a computation it calls: fusions, branches,
    reductions, nested loops) has a dot product: a loop without one (XLA:CPU may expand a
    scatter into a loop) leaves the count right."""
    computations, name, todo = {}, None, []  # todo: the loops' bodies.
    for line in hlo.splitlines():
        header = _HLO_COMPUTATION.match(line)
        if header:
            name = header.group(1)
        elif name:
            computations.setdefault(name, []).append(line)
            if _HLO_WHILE.search(line):
                todo += _HLO_BODY.findall(line)
    seen = set()
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            for line in computations.get(name, ()):
                if _HLO_DOT.search(line):
                    return True
                todo += [n for n in _HLO_NAME.findall(line) if n in computations]
    return False


def compiled_products(hlo: str) -> list[Product]:
    """The dot products of a compiled XLA program (`jitted.lower(...).compile().as_text()`),
    fused or not, each distinct one once with its count, largest FLOPs first. A program whose
    loop has products (a scanned layer stack, decoding) runs them more than once, which the
    text does not count: ValueError."""
    if _looped_products(hlo):
        raise ValueError("the program has a loop: its products' counts are not in its text")
    values, found = {}, collections.Counter()
    for line in hlo.splitlines():
        match = _HLO_VALUE.match(line)
        if match:
            dims = tuple(int(n) for n in match.group(3).split(",") if n)
            values[match.group(1)] = (match.group(2), dims)
    for line in hlo.splitlines():
        dot = _HLO_DOT.search(line)
        if not dot or not _HLO_VALUE.match(line):
            continue
        lhs, rhs = (values[name] for name in re.findall(r"%([\w.\-]+)", dot.group(1)))
        dims = {name: tuple(int(n) for n in numbers.split(",") if n)
                for name, numbers in _HLO_DIMS.findall(line)}  # fmt: skip
        numbers = tuple(
            tuple(dims.get(f"{side}_{kind}_dims", ()) for side in ("lhs", "rhs"))
            for kind in ("contracting", "batch")
        )
        found[(lhs[1], rhs[1], (lhs[0], rhs[0]), numbers)] += 1
    products = [Product(*key, count=count) for key, count in found.items()]
    return sorted(products, key=lambda p: -p.flops * p.count)


def jaxpr_flops(jaxpr: Any) -> int:
    """Matmul FLOPs (2 per multiply-add of every dot_general) of a jaxpr (`jax.make_jaxpr`'s, or
    a jitted function's `.trace(...).jaxpr`), a scan's body counted `length` times and a
    conditional at its costliest branch. XLA's own cost analysis counts a loop's body once,
    which undercounts every scanned layer stack and every chunked loss."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (contracting, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            inner = math.prod(lhs[i] for i in contracting)
            total += 2 * math.prod(eqn.outvars[0].aval.shape) * inner
            continue
        subs = [jaxpr_flops(sub) for sub in _sub_jaxprs(eqn.params)]
        if eqn.primitive.name == "cond":
            total += max(subs, default=0)
        else:
            total += eqn.params.get("length", 1) * sum(subs)
    return total


def _sub_jaxprs(params: dict) -> list:
    """The jaxprs an equation's parameters hold (bodies, branches, called functions)."""
    found = []
    for value in params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if hasattr(item, "eqns") or hasattr(getattr(item, "jaxpr", None), "eqns"):
                found.append(item)
    return found
