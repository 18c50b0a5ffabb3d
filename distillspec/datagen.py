"""Where each training step's sequences come from (DistillSpec Algorithm A.2), as fixed shapes.

A step draws u1, u2 ~ U(0, 1) from (seed, step) alone, never from a global RNG, so an interrupted
run that resumes at step s sees exactly the data it would have seen:
  u1 <= lambda1              -> the fixed data set's (prompt, completion) pairs;
  else u2 <= lambda2         -> completions sampled from the student (on-policy);
  else                       -> completions sampled from the teacher.
With `per_example`, each example of the batch draws its own (u1, u2). Before them, with a
served-data fraction lambda0 > 0, u0 <= lambda0 makes the whole batch served data: prompts and
outputs a recording decoder served, with the target's top-k already computed
(`distillspec.served`; the trainer runs no teacher on them).

Sequences are then packed into the T5X feature names the models take (`decoder_input_tokens`,
plus `encoder_input_tokens` for encoder-decoders) with `weights` that are 1 exactly on the
positions that predict a completion token: prompt and padding carry zero weight.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from distillspec.decoding import generate_on_device
from distillspec.decoding.sampling import SamplingConfig

DATASET, STUDENT, TEACHER, SERVED = 0, 1, 2, 3
SOURCE_NAMES = ("dataset", "student", "teacher", "served")
# The paper's names for DataMixture's fields, quoted in validation errors.
LAMBDA_NAMES = {
    "fixed_data_fraction": "lambda1",
    "student_data_fraction": "lambda2",
    "served_data_fraction": "lambda0",
}


@dataclasses.dataclass(frozen=True)
class DataMixture:
    """The training-data mixture G of DistillSpec's Algorithm A.2."""

    fixed_data_fraction: float = 0.0  # lambda1 in [0, 1]: probability of fixed data per step.
    student_data_fraction: float = 1.0  # lambda2 in [0, 1]: otherwise, probability of student data.
    per_example: bool = False  # Draw the source per example instead of per batch.
    temperature: float = 1.0  # Sampling temperature of generated data (the paper's finding: 1.0).
    # lambda0 in [0, 1]: probability that a step's whole batch is served data (`distillspec.served`,
    # train.served_buffer), drawn before lambda1 and lambda2; those steps run no teacher.
    served_data_fraction: float = 0.0

    def __post_init__(self):
        for name in ("fixed_data_fraction", "student_data_fraction", "served_data_fraction"):
            value = getattr(self, name)
            if not 0 <= value <= 1:
                raise ValueError(
                    f"DataMixture.{name} ({LAMBDA_NAMES[name]}) must be in [0, 1], got {value!r}"
                )
        if not self.temperature > 0:
            raise ValueError(
                f"DataMixture.temperature must be > 0 for sampled data, got {self.temperature!r}"
            )

    @property
    def needs_teacher_samples(self) -> bool:
        return self.fixed_data_fraction < 1 and self.student_data_fraction < 1

    @property
    def needs_student_samples(self) -> bool:
        return self.fixed_data_fraction < 1 and self.student_data_fraction > 0


def step_sources(seed: int, step: int, batch_size: int, mixture: DataMixture) -> np.ndarray:
    """Source of each example of this step: [B] int in (DATASET, STUDENT, TEACHER)."""
    draws = 1 if not mixture.per_example else batch_size
    if mixture.served_data_fraction > 0:  # Its own stream: lambda0 = 0 leaves the rest as is.
        if np.random.default_rng([seed, step, 0xA0]).uniform() < mixture.served_data_fraction:
            return np.full((batch_size,), SERVED, np.int32)
    u1, u2 = np.random.default_rng([seed, step, 0xA2]).uniform(size=(2, draws))
    # u ~ U[0, 1) can be exactly 0.0, so a strict '<' makes lambda = 0 mean "never" (with
    # '<=' a fraction of 0 could still pick that source); lambda = 1 still means "always".
    sources = np.where(
        u1 < mixture.fixed_data_fraction,
        DATASET,
        np.where(u2 < mixture.student_data_fraction, STUDENT, TEACHER),
    )
    return np.broadcast_to(sources, (batch_size,)).astype(np.int32)


def pack_decoder_only(prompts, prompt_lengths, completions, completion_lengths) -> dict:
    """Right-padded prompt ++ completion rows for a decoder-only model.

    Args:
      prompts: [B, P] right-padded prompt tokens; prompt_lengths: [B] (>= 1).
      completions: [B, N] right-padded completion tokens; completion_lengths: [B].

    Returns:
      decoder_input_tokens [B, P + N], targets [B, P + N] (the next token at each position),
      weights [B, P + N] float32: 1 where the next token is a completion token,
      loss_positions [B, N] int32: prompt_length - 1 + j, the positions that can carry weight
      (the trainer computes logits there only).
    """
    prompts, completions = jnp.asarray(prompts, jnp.int32), jnp.asarray(completions, jnp.int32)
    prompt_lengths = jnp.asarray(prompt_lengths, jnp.int32)
    completion_lengths = jnp.asarray(completion_lengths, jnp.int32)
    n = completions.shape[1]
    index = jnp.arange(completions.shape[1])
    completions = jnp.where(index < completion_lengths[:, None], completions, 0)
    tokens = jnp.pad(prompts, ((0, 0), (0, n)))
    tokens = jnp.where(jnp.arange(tokens.shape[1]) < prompt_lengths[:, None], tokens, 0)
    tokens = jax.vmap(lambda row, c, s: jax.lax.dynamic_update_slice(row, c, (s,)))(
        tokens, completions, prompt_lengths
    )
    position = jnp.arange(tokens.shape[1])
    first = prompt_lengths[:, None] - 1
    weights = (position >= first) & (position < first + completion_lengths[:, None])
    targets = jnp.pad(tokens[:, 1:], ((0, 0), (0, 1)))
    return {
        "decoder_input_tokens": tokens,
        "targets": targets,
        "weights": weights.astype(jnp.float32),
        "loss_positions": first + jnp.arange(n, dtype=jnp.int32),
    }


def pack_encoder_decoder(prompts, prompt_lengths, completions, completion_lengths) -> dict:
    """Encoder input = prompt; decoder input = start token 0 ++ completion[:-1] (T5 convention)."""
    del prompt_lengths  # Encoder padding is id 0.
    completions = jnp.asarray(completions, jnp.int32)
    completion_lengths = jnp.asarray(completion_lengths, jnp.int32)
    weights = jnp.arange(completions.shape[1]) < completion_lengths[:, None]
    targets = jnp.where(weights, completions, 0)
    return {
        "encoder_input_tokens": jnp.asarray(prompts, jnp.int32),
        "decoder_input_tokens": jnp.pad(targets[:, :-1], ((0, 0), (1, 0))),
        "targets": targets,
        "weights": weights.astype(jnp.float32),
    }


def pack_for(model):
    """The packer of the model's family: `pack_encoder_decoder` or `pack_decoder_only`."""
    return pack_encoder_decoder if model.encoder_decoder else pack_decoder_only


def pack_teacher_forcing(
    model, prompt_tokens, prompt_lengths, completion_tokens, completion_lengths
) -> tuple[dict[str, jax.Array], jax.Array]:
    """Teacher-forcing inputs of `model`'s family for prompt + completion rows, as in training.

    Returns:
      (batch, weights): the model inputs of `pack_decoder_only` (decoder_input_tokens [B, P+N],
      weights 1 at positions p-1 .. p+n-2) or of `pack_encoder_decoder` (encoder_input_tokens
      [B, P], decoder_input_tokens [B, N] = [0] + completion[:-1], weights 1 at positions < n).
    """
    batch = pack_for(model)(prompt_tokens, prompt_lengths, completion_tokens, completion_lengths)
    weights = batch.pop("weights")
    del batch["targets"]
    return batch, weights


def select_rows(sources: np.ndarray, candidates: dict[int, tuple]) -> tuple:
    """Per-row choice among candidate (completions [B, N], lengths [B]) by source id [B]."""
    first = next(iter(candidates.values()))
    out = [np.array(x) for x in first]
    for source, (tokens, lengths) in candidates.items():
        rows = sources == source
        out[0][rows], out[1][rows] = np.asarray(tokens)[rows], np.asarray(lengths)[rows]
    return tuple(out)


@dataclasses.dataclass
class ExampleStore:
    """A task split held as fixed-shape arrays, with O(1) random access by (seed, step).

    The batch of step s is examples perm_e[g mod n] for the global example indices
    g = s * B ... s * B + B - 1, where e = g // n and perm_e is a permutation drawn from
    (seed, e): the data order is a function of (seed, step), which is what makes a resumed run
    see the same data as an uninterrupted one.
    """

    prompts: np.ndarray  # [n, P] int32, right-padded.
    prompt_lengths: np.ndarray  # [n] int32, >= 1.
    completions: np.ndarray  # [n, N] int32, right-padded.
    completion_lengths: np.ndarray  # [n] int32.
    shard: tuple[int, ...] = ()  # (index,) of a data shard: its own permutations (ShardedData).

    def __post_init__(self):
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.prompt_lengths)

    @classmethod
    def from_batches(cls, batches, max_examples: int | None = None) -> ExampleStore:
        """Collects the valid rows of `feature_converters.prompt_batches`-style dicts."""
        rows = {
            k: []
            for k in ("prompt_tokens", "prompt_lengths", "completion_tokens", "completion_lengths")
        }
        collected = 0
        for batch in batches:
            keep = batch["valid"] & (batch["prompt_lengths"] > 0)
            for key, values in rows.items():
                values.append(batch[key][keep])
            collected += int(np.sum(keep))
            # Stop reading the split once max_examples rows are in hand (a smoke test's 64
            # examples should not cost a pass over the whole split).
            if max_examples is not None and collected >= max_examples:
                break
        arrays = {k: np.concatenate(v) if v else np.zeros((0,)) for k, v in rows.items()}
        if max_examples is not None:
            arrays = {k: v[:max_examples] for k, v in arrays.items()}
        return cls(*(arrays[k].astype(np.int32) for k in rows))

    def _perm(self, seed: int, epoch: int) -> np.ndarray:
        if (seed, epoch) not in self._perms:
            self._perms = {
                (seed, epoch): np.random.default_rng([seed, epoch, *self.shard]).permutation(
                    len(self)
                )
            }
        return self._perms[(seed, epoch)]

    def indices(self, seed: int, step: int, batch_size: int) -> np.ndarray:
        n = len(self)
        global_index = step * batch_size + np.arange(batch_size)
        epochs, offsets = global_index // n, global_index % n
        return np.array([self._perm(seed, int(e))[o] for e, o in zip(epochs, offsets)])

    def batch(self, seed: int, step: int, batch_size: int) -> dict[str, np.ndarray]:
        i = self.indices(seed, step, batch_size)
        return {
            "prompt_tokens": self.prompts[i],
            "prompt_lengths": self.prompt_lengths[i],
            "completion_tokens": self.completions[i],
            "completion_lengths": self.completion_lengths[i],
        }


@dataclasses.dataclass
class ShardedData:
    """The data shards of the training split that this process reads.

    The split is read in `num_shards` seqio shards (ShardInfo); the global batch of step s is
    the concatenation, in shard order, of every shard's `ExampleStore.batch(seed, s,
    batch_size // num_shards)`. A process holds the stores of its own shards only, and
    `batch` returns its rows of the global batch; processes that are model-parallel replicas
    of each other hold the same shards. One shard is `ExampleStore.batch` itself.
    """

    stores: dict[int, ExampleStore]  # {shard index: that shard's examples}, this process's.
    num_shards: int = 1  # Shards of the whole split, over all processes.

    def batch(self, seed: int, step: int, batch_size: int) -> dict[str, np.ndarray]:
        """This process's rows of step `step`'s global batch of `batch_size` examples."""
        per_shard = batch_size // self.num_shards
        parts = [self.stores[k].batch(seed, step, per_shard) for k in sorted(self.stores)]
        return {key: np.concatenate([part[key] for part in parts]) for key in parts[0]}


def present_sources(sources: np.ndarray) -> tuple[int, ...]:
    """The generated sources (STUDENT, TEACHER) that occur in a step's [B] sources."""
    return tuple(source for source in (STUDENT, TEACHER) if np.any(sources == source))


def step_completions(
    batch: dict, sources, models: dict, rng: jax.Array, mixture: DataMixture, eos_id,
    present: tuple[int, ...],
) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """This step's completions [B, N] and lengths [B]: data rows, student or teacher samples.

    Traceable: the trainer calls it inside jit, on the global arrays of a multi-process run,
    so that sampling never leaves the devices.

    Args:
      batch: an `ExampleStore.batch` (arrays).
      sources: [B] source per example (`step_sources`).
      models: {STUDENT: (model, params), TEACHER: (model, params)}.
      rng: this step's key; eos_id: sampling stops a row after this id.
      present: the generated sources that occur in `sources` (`present_sources`, static):
        only these are sampled, each once for the whole batch.
    """
    prompts, lengths = batch["prompt_tokens"], batch["prompt_lengths"]
    tokens = jnp.asarray(batch["completion_tokens"], jnp.int32)
    token_lengths = jnp.asarray(batch["completion_lengths"], jnp.int32)
    sampling = SamplingConfig(temperature=mixture.temperature)
    for source in present:
        model, params = models[source]
        out = generate_on_device(
            model, params, prompts, lengths, jax.random.fold_in(rng, source),
            max_new_tokens=tokens.shape[1], sampling=sampling, eos_id=eos_id,
        )  # fmt: skip
        rows = sources == source
        tokens = jnp.where(rows[:, None], out["tokens"], tokens)
        token_lengths = jnp.where(rows, out["lengths"], token_lengths)
    return tokens, token_lengths
