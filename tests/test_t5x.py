"""T5X checkpoints: conformance, round trips, the CLI, dispatch, errors and sharded reads.

The T5X checkpoints here are written by the test itself, with flax's msgpack and tensorstore only
(t5x is not installed), straight from a tiny random transformers T5 v1.1 (no distillspec code in
between), so that a mistake shared by our reader and writer cannot cancel out.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import textwrap

import gin
import jax
import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
from flax import serialization

from distillspec import convert, gin_setup, metrics
from distillspec.models import (
    T5LM,
    T5Config,
    checkpoint_format,
    from_pretrained,
    from_t5x,
    load_checkpoint,
    save_t5x,
    t5x_store,
)
from tests.test_hf_interop import TOL, _batch, _hf_logits, _our_logits, _random_hf_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEP = 5


# --------------------------------------------------------------------------------------------
# A T5X writer independent of distillspec: HF tensors -> T5X names -> msgpack + zarr.
# --------------------------------------------------------------------------------------------


def _t5x_arrays(hf_model) -> dict[str, np.ndarray]:
    """The T5X (t5x/examples/t5/network.py) parameters of a transformers T5 v1.1."""
    sd = {k: v.detach().float().numpy() for k, v in hf_model.state_dict().items()}
    config = hf_model.config
    arrays = {
        "token_embedder/embedding": sd["shared.weight"],
        "decoder/logits_dense/kernel": sd["lm_head.weight"].T,  # Linear [V, E] -> [E, V].
    }
    stacks = {
        "encoder": (
            config.num_layers,
            [("SelfAttention", "attention", "pre_attention_layer_norm")],
        ),
        "decoder": (
            config.num_decoder_layers,
            [
                ("SelfAttention", "self_attention", "pre_self_attention_layer_norm"),
                ("EncDecAttention", "encoder_decoder_attention", "pre_cross_attention_layer_norm"),
            ],
        ),
    }
    for stack, (layers, attentions) in stacks.items():
        bias = f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
        arrays[f"{stack}/relpos_bias/rel_embedding"] = sd[bias].T  # [buckets, H] -> [H, buckets].
        arrays[f"{stack}/{stack}_norm/scale"] = sd[f"{stack}.final_layer_norm.weight"]
        for i in range(layers):
            hf, t5x = f"{stack}.block.{i}.layer.", f"{stack}/layers_{i}/"
            for j, (hf_attention, module, norm) in enumerate(attentions):
                arrays[f"{t5x}{norm}/scale"] = sd[f"{hf}{j}.layer_norm.weight"]
                for hf_name, name in (("q", "query"), ("k", "key"), ("v", "value"), ("o", "out")):
                    # q/k/v: [H*D, E] -> [E, H*D]; o: [E, H*D] -> [H*D, E].
                    arrays[f"{t5x}{module}/{name}/kernel"] = sd[
                        f"{hf}{j}.{hf_attention}.{hf_name}.weight"
                    ].T
            mlp = f"{hf}{len(attentions)}."
            arrays[f"{t5x}pre_mlp_layer_norm/scale"] = sd[f"{mlp}layer_norm.weight"]
            for name in ("wi_0", "wi_1", "wo"):
                arrays[f"{t5x}mlp/{name}/kernel"] = sd[f"{mlp}DenseReluDense.{name}.weight"].T
    return {name: np.ascontiguousarray(value) for name, value in arrays.items()}


def _nest(flat: dict[str, object]) -> dict:
    tree: dict = {}
    for name, value in flat.items():
        node = tree
        *parents, leaf = name.split("/")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return tree


def write_t5x(step_dir: str, arrays: dict[str, np.ndarray], step: int = STEP) -> None:
    """A T5X step directory as T5X's Checkpointer lays it out, with every leaf kind: most arrays
    in zarr (chunks of half each side, gzip) referenced by dict specs, one through a 'gcs' spec
    with T5X's dummy bucket, one as an orbax 'PLACEHOLDER://' leaf, the decoder norm inline;
    plus the step and Adafactor-like optimizer state, which are not parameters."""
    os.makedirs(step_dir)
    target = {}
    for name, value in arrays.items():
        if name == "decoder/decoder_norm/scale":
            target[name] = value  # Inline, as T5X writes unpartitioned arrays.
            continue
        relative = "target." + name.replace("/", ".")
        metadata = {
            "compressor": {"id": "gzip"},
            "shape": list(value.shape),
            "chunks": [max(1, n // 2) for n in value.shape],
        }
        spec = {
            "driver": "zarr",
            "dtype": value.dtype.name,
            "kvstore": {"driver": "file", "path": os.path.join(step_dir, relative)},
            "metadata": metadata,
        }
        ts.open(spec, create=True).result().write(value).result()
        if name == "encoder/layers_0/mlp/wo/kernel":
            target[name] = "PLACEHOLDER://" + relative
        elif name == "encoder/layers_1/mlp/wo/kernel":
            gcs = {"driver": "gcs", "bucket": "t5x-dummy-bucket", "path": relative}
            target[name] = {**spec, "kvstore": gcs}
        else:
            target[name] = {**spec, "kvstore": {"driver": "file", "path": relative}}
    rows, columns = arrays["encoder/layers_0/mlp/wi_0/kernel"].shape
    factored = {"v_row": np.ones(rows, np.float32), "v_col": np.ones(columns, np.float32)}
    param_states = _nest({"encoder/layers_0/mlp/wi_0/kernel": factored})
    contents = {
        "version": 3,
        "optimizer": {
            "target": _nest(target),
            "state": {"step": np.asarray(step, np.int32), "param_states": param_states},
        },
    }
    with open(os.path.join(step_dir, "checkpoint"), "wb") as f:
        f.write(serialization.msgpack_serialize(contents))


def _read_step_dir(step_dir: str) -> dict[str, np.ndarray]:
    """Every optimizer/target array of a step directory, read with flax + tensorstore only."""
    with open(os.path.join(step_dir, "checkpoint"), "rb") as f:
        contents = serialization.msgpack_restore(f.read())
    assert contents["version"] == 3
    out = {}

    def walk(node, prefix):
        if isinstance(node, dict) and "driver" not in node:
            for key, value in node.items():
                walk(value, f"{prefix}/{key}" if prefix else key)
            return
        relative = None
        if isinstance(node, str):  # An orbax placeholder.
            relative = node.removeprefix("PLACEHOLDER://")
        elif isinstance(node, dict):
            assert node["driver"] == "zarr" and node["metadata"]["compressor"]["id"] == "gzip"
            relative = node["kvstore"]["path"]
        if relative is not None:
            assert not os.path.isabs(relative)  # Portable: paths relative to the step directory.
            path = os.path.join(step_dir, relative)
            node = ts.open({"driver": "zarr", "kvstore": {"driver": "file", "path": path}}).result()
            node = node.read().result()
        out[prefix] = np.asarray(node)

    walk(contents["optimizer"]["target"], "")
    return out


@pytest.fixture(scope="module")
def twin(tmp_path_factory):
    """A tiny random HF T5 v1.1, its HF directory, and a T5X model directory of the same weights
    (step 5, plus an older step 2 and an unfinished step 9 that must be skipped)."""
    root = tmp_path_factory.mktemp("twin")
    hf_model = _random_hf_model("t5")
    hf_model.save_pretrained(root / "hf")
    arrays = _t5x_arrays(hf_model)
    model_dir = root / "t5x"
    write_t5x(str(model_dir / "checkpoint_2"), {k: 0 * v for k, v in arrays.items()}, step=2)
    write_t5x(str(model_dir / f"checkpoint_{STEP}"), arrays)
    os.makedirs(model_dir / "checkpoint_9.tmp-1700000000")  # An interrupted T5X save.
    reference, reference_params = from_pretrained(str(root / "hf"))
    return {
        "hf_model": hf_model, "hf_dir": str(root / "hf"), "model_dir": str(model_dir),
        "step_dir": str(model_dir / f"checkpoint_{STEP}"), "arrays": arrays,
        "config": reference.config, "params": reference_params,
    }  # fmt: skip


def _copy(twin, tmp_path) -> str:
    step_dir = str(tmp_path / "t5x" / f"checkpoint_{STEP}")
    shutil.copytree(twin["step_dir"], step_dir)
    return step_dir


def _assert_trees_bit_equal(a, b) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8))


def _random_params(model, seed: int):
    """Random float32 params of `model`'s shapes (no compiled init: the tests stay fast)."""
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0))
    return jax.tree.map(lambda x: rng.standard_normal(x.shape).astype(np.float32), shapes)


# --------------------------------------------------------------------------------------------
# Loading.
# --------------------------------------------------------------------------------------------


def test_t5x_copy_gives_the_transformers_logits(twin, caplog):
    with caplog.at_level(logging.INFO, logger="distillspec.models"):
        model, params = from_t5x(twin["model_dir"], twin["config"])
    assert f"latest step, {STEP}" in caplog.text  # Not 2, nor the unfinished 9.
    batch = _batch()
    expected = _hf_logits(twin["hf_model"], batch, is_t5=True)
    assert expected.std() > 0.3  # Logits are far from trivially small.
    error = float(np.max(np.abs(_our_logits(model, params, batch) - expected)))
    assert error <= TOL, error
    # The same float32 params as the Hugging Face converter, bit for bit.
    _assert_trees_bit_equal(params, twin["params"])


def test_config_is_inferred_from_the_shapes(twin):
    model, params = from_t5x(twin["step_dir"])
    # relative_max_distance is not stored in T5X checkpoints: T5X's 128 is assumed.
    assert model.config == T5Config(**{**vars(twin["config"]), "relative_max_distance": 128})
    _assert_trees_bit_equal(params, twin["params"])


# --------------------------------------------------------------------------------------------
# Saving.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True], ids=["logits_dense", "logits_via_embedding"])
def test_save_load_round_trip_is_bit_exact_with_bfloat16_arrays(tied, tmp_path):
    config = T5Config(vocab_size=40, embed_dim=16, num_heads=2, head_dim=8, mlp_dim=24,
                      num_decoder_layers=3, relative_buckets=8, tie_embeddings=tied,
                      scale_decoder_outputs=tied)  # fmt: skip
    model = T5LM(config)
    params = _random_params(model, 1)
    # Half the leaves held in bfloat16: they are stored as native zarr bfloat16.
    leaves, treedef = jax.tree.flatten(params)
    mixed = jax.tree.unflatten(
        treedef, [x.astype("bfloat16") if i % 2 else x for i, x in enumerate(leaves)]
    )
    step_dir = save_t5x(model, mixed, str(tmp_path), step=7)
    assert step_dir == str(tmp_path / "checkpoint_7")
    assert os.listdir(tmp_path) == ["checkpoint_7"]  # No temporary directory left behind.
    stored = _read_step_dir(step_dir)
    assert {a.dtype for a in stored.values()} == {np.dtype("float32"), np.dtype(ml_dtypes.bfloat16)}
    assert ("decoder/logits_dense/kernel" in stored) == (not tied)
    with open(os.path.join(step_dir, "checkpoint"), "rb") as f:
        assert serialization.msgpack_restore(f.read())["optimizer"]["state"]["step"] == 7

    loaded_model, loaded = from_t5x(str(tmp_path))  # Config inferred, tied head included.
    assert loaded_model.config == config
    _assert_trees_bit_equal(loaded, jax.tree.map(lambda x: np.asarray(x, np.float32), mixed))
    # Saving the loaded params as bfloat16 gives back the very same bytes on disk.
    again = save_t5x(loaded_model, loaded, str(tmp_path / "again"), step=7, dtype="bfloat16")
    for name, array in _read_step_dir(again).items():
        assert array.dtype == ml_dtypes.bfloat16
        original = stored[name].astype(ml_dtypes.bfloat16)
        np.testing.assert_array_equal(array.view(np.uint16), original.view(np.uint16))
    with pytest.raises(FileExistsError, match="checkpoint_7"):
        save_t5x(model, params, str(tmp_path), step=7)


def test_unscaled_tied_head_is_written_as_an_explicit_logits_dense(tmp_path):
    config = T5Config(vocab_size=40, embed_dim=16, num_heads=2, head_dim=8, mlp_dim=24,
                      tie_embeddings=True)  # fmt: skip
    model = T5LM(config)
    params = _random_params(model, 2)
    stored = _read_step_dir(save_t5x(model, params, str(tmp_path)))
    np.testing.assert_array_equal(
        stored["decoder/logits_dense/kernel"], np.asarray(params["embed"]["embedding"]).T
    )


def test_an_interrupted_save_leaves_no_checkpoint(tmp_path, monkeypatch):
    model = T5LM(T5Config(vocab_size=40, embed_dim=16, num_heads=2, head_dim=8, mlp_dim=24))
    params = _random_params(model, 3)
    write, calls = t5x_store.write_array, []

    def failing_write(*args):
        calls.append(1)
        if len(calls) == 10:
            raise KeyboardInterrupt  # E.g. a preempted job.
        return write(*args)

    monkeypatch.setattr(t5x_store, "write_array", failing_write)
    with pytest.raises(KeyboardInterrupt):
        save_t5x(model, params, str(tmp_path), step=3)
    assert len(calls) == 10 and os.listdir(tmp_path) == []
    with pytest.raises(FileNotFoundError, match="No T5X checkpoint"):
        from_t5x(str(tmp_path))


# --------------------------------------------------------------------------------------------
# The CLI and the dispatcher.
# --------------------------------------------------------------------------------------------


def test_cli_t5x_to_hf_to_t5x_is_bit_exact(twin, tmp_path, capsys):
    hf_dir, t5x_dir = str(tmp_path / "hf"), str(tmp_path / "t5x")
    gin_file = tmp_path / "tiny.gin"  # The architecture through --config (a gin file).
    bindings = [f"tiny/T5Config.{k} = {v!r}" for k, v in vars(twin["config"]).items()]
    gin_file.write_text("\n".join(bindings) + "\n")
    argv = ["--from", "t5x", "--to", "hf", twin["model_dir"], hf_dir, "--config", str(gin_file)]
    assert convert.main(argv) == 0
    assert "model.safetensors" in capsys.readouterr().out
    reloaded = transformers.T5ForConditionalGeneration.from_pretrained(hf_dir).eval()
    batch = _batch()
    error = np.abs(_hf_logits(reloaded, batch, True) - _hf_logits(twin["hf_model"], batch, True))
    assert float(error.max()) <= TOL

    assert convert.main(["--from", "hf", "--to", "t5x", hf_dir, t5x_dir]) == 0
    assert "TensorStore arrays" in capsys.readouterr().out
    converted = _read_step_dir(os.path.join(t5x_dir, "checkpoint_0"))
    original = _read_step_dir(twin["step_dir"])
    assert converted.keys() == original.keys()
    for name, array in original.items():
        assert converted[name].dtype == array.dtype, name
        np.testing.assert_array_equal(converted[name].view(np.uint32), array.view(np.uint32))


# The published T5 v1.1 sizes (d_model, d_ff, layers, heads).
SIZES = {
    "small": (512, 1024, 8, 6),
    "base": (768, 2048, 12, 12),
    "large": (1024, 2816, 24, 16),
    "xl": (2048, 5120, 24, 32),
    "xxl": (4096, 10240, 24, 64),
}


@pytest.mark.parametrize("size", sorted(SIZES))
def test_size_configs_have_the_published_sizes(size):
    width, mlp, layers, heads = SIZES[size]
    assert convert.resolve_config(size) == T5Config(
        vocab_size=32128, embed_dim=width, num_encoder_layers=layers, num_decoder_layers=layers,
        num_heads=heads, head_dim=64, mlp_dim=mlp, relative_buckets=32, relative_max_distance=128,
    )  # fmt: skip


def test_load_checkpoint_dispatches_both_formats(twin, tmp_path):
    assert checkpoint_format(twin["hf_dir"]) == "hf"
    assert checkpoint_format(twin["model_dir"]) == "t5x"
    assert checkpoint_format(twin["step_dir"]) == "t5x"
    model, params = load_checkpoint(twin["hf_dir"])
    assert isinstance(model, T5LM)
    _assert_trees_bit_equal(params, twin["params"])
    model, params = load_checkpoint(twin["model_dir"], config=twin["config"], dtype="bfloat16")
    assert isinstance(model, T5LM) and model.config.dtype == "bfloat16"
    _assert_trees_bit_equal(params, twin["params"])
    with pytest.raises(ValueError, match=r"\['config'\] apply to T5X checkpoints only"):
        load_checkpoint(twin["hf_dir"], config=twin["config"])
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="not a recognised checkpoint") as error:
        load_checkpoint(str(tmp_path))
    for expected in ("config.json", "model.safetensors", "checkpoint_<step>", "weights.bin"):
        assert expected in str(error.value)


# --------------------------------------------------------------------------------------------
# A T5X teacher in a train run.
# --------------------------------------------------------------------------------------------


def test_train_distils_a_t5_student_from_a_t5x_teacher(tmp_path):
    """`python -m distillspec.train` with train.teacher_checkpoint a T5X model directory: the
    tiny distillation of configs/tests/tiny_distill.gin, with T5 v1.1 teacher and student."""
    teacher = T5LM(
        T5Config(vocab_size=260, embed_dim=32, num_heads=4, head_dim=8, mlp_dim=64,
                 num_encoder_layers=1, num_decoder_layers=2)
    )  # fmt: skip
    params = jax.tree.map(lambda x: 0.5 * x, _random_params(teacher, 5))
    save_t5x(teacher, params, str(tmp_path / "teacher"), step=7)
    model_dir = tmp_path / "run"
    student = {"vocab_size": 260, "embed_dim": 16, "num_heads": 2, "head_dim": 8, "mlp_dim": 32,
               "num_encoder_layers": 1, "num_decoder_layers": 1}  # fmt: skip
    gin.clear_config()
    try:
        gin_setup.main(
            "train",
            [
                f"--gin_file={REPO_ROOT}/configs/tests/tiny_distill.gin",
                f"--gin.MODEL_DIR={model_dir}",
                "--gin.TRAIN_STEPS=2",
                "--gin.train.teacher=None",
                f"--gin.train.teacher_checkpoint={tmp_path / 'teacher'}",
                "--gin.train.student=@student/T5LM()",
                "--gin.student/T5LM.config=@student/T5Config()",
                *(f"--gin.student/T5Config.{k}={v}" for k, v in student.items()),
            ],
        )
    finally:
        gin.clear_config()
    logged = metrics.read_metrics(str(model_dir))
    assert [r["step"] for r in logged] == [1, 2]
    assert all(np.isfinite(r["loss"]) for r in logged)
    assert "teacher_checkpoint" in (model_dir / "config.gin").read_text()
    exported, exported_params = from_pretrained(str(model_dir / "export"))
    assert isinstance(exported, T5LM) and exported.config.embed_dim == 16
    assert exported.vocab_size == 260 and exported_params["embed"]["embedding"].shape == (260, 16)


def test_train_refuses_a_decoder_only_student_for_an_encoder_decoder_teacher():
    from distillspec.models import DecoderOnlyLM, TransformerConfig
    from distillspec.runs.common import check_models_serve
    from distillspec.vocabularies import load_tokenizer

    student = DecoderOnlyLM(TransformerConfig(vocab_size=260))
    teacher = T5LM(T5Config(vocab_size=260))
    with pytest.raises(ValueError, match="decoder-only or all encoder-decoder: {'student'"):
        check_models_serve(
            {"student": student, "teacher": teacher}, load_tokenizer("byte"), None, "vocab_size"
        )


# --------------------------------------------------------------------------------------------
# Errors.
# --------------------------------------------------------------------------------------------


def _rewrite_target(step_dir: str, edit) -> None:
    path = os.path.join(step_dir, "checkpoint")
    with open(path, "rb") as f:
        contents = serialization.msgpack_restore(f.read())
    edit(contents["optimizer"]["target"])
    with open(path, "wb") as f:
        f.write(serialization.msgpack_serialize(contents))


def test_truncated_array_names_the_array(twin, tmp_path):
    step_dir = _copy(twin, tmp_path)
    array = os.path.join(step_dir, "target.decoder.layers_2.mlp.wi_1.kernel")
    chunk = os.path.join(array, "1.1")
    data = open(chunk, "rb").read()
    open(chunk, "wb").write(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated or corrupt") as error:
        from_t5x(step_dir, twin["config"])
    assert array in str(error.value) and "target/decoder/layers_2/mlp/wi_1/kernel" in str(
        error.value
    )
    os.remove(os.path.join(array, ".zarray"))  # Now the array's metadata is gone too.
    with pytest.raises(ValueError, match="target.decoder.layers_2.mlp.wi_1.kernel"):
        from_t5x(step_dir, twin["config"])


def test_missing_parameter_is_named(twin, tmp_path):
    step_dir = _copy(twin, tmp_path)
    _rewrite_target(step_dir, lambda t: t["decoder"]["layers_1"]["mlp"].pop("wo"))
    with pytest.raises(ValueError, match="lacks parameter 'target/decoder/layers_1/mlp/wo/kernel'"):
        from_t5x(step_dir, twin["config"])


def test_shape_mismatch_names_both_shapes(twin, tmp_path):
    config = T5Config(**{**vars(twin["config"]), "mlp_dim": 64})
    with pytest.raises(ValueError) as error:
        from_t5x(twin["step_dir"], config)
    message = str(error.value)
    assert "'target/encoder/layers_0/mlp/wi_0/kernel'" in message
    assert "(32, 48)" in message and "(32, 64)" in message


def test_uninferable_head_count_asks_for_a_config(twin, tmp_path):
    step_dir = _copy(twin, tmp_path)
    _rewrite_target(step_dir, lambda t: t["encoder"].pop("relpos_bias"))
    with pytest.raises(ValueError, match="number of attention heads") as error:
        from_t5x(step_dir)
    assert "config=" in str(error.value) and ".gin" in str(error.value)


# --------------------------------------------------------------------------------------------
# Sharded reads on 8 devices (a subprocess: the device count is fixed when jax starts).
# --------------------------------------------------------------------------------------------

_SHARDED = textwrap.dedent(
    """
    import sys
    import jax, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from distillspec.models import t5x, t5x_store

    assert len(jax.devices()) == 8, jax.devices()
    path = sys.argv[1]
    _, reference = t5x.from_t5x(path)
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))

    def spec(path, leaf):
        keys = [k.key for k in path]
        if keys[-2] in ("q", "k", "v"):  # [L, E, H, D]: heads and head_dim both split.
            return P(None, None, "a", "b")
        if keys[-2] == "o":  # [L, H, D, E]
            return P(None, "a", "b", None)
        if keys[-1] == "embedding" and keys[-2] == "relpos":  # [buckets, H]
            return P("b", "a")
        first = 1 if "layers" in keys else 0
        axis = max(i for i in range(first, leaf.ndim) if leaf.shape[i] % 8 == 0)
        return P(*[("a", "b") if i == axis else None for i in range(leaf.ndim)])

    shardings = jax.tree_util.tree_map_with_path(
        lambda p, x: NamedSharding(mesh, spec(p, x)), reference)
    reads = []  # (elements read, elements of that T5X array), for every TensorStore read.
    read = t5x_store.Source.read
    def counting_read(self, index):
        out = read(self, index)
        reads.append((out.size, int(np.prod(self.shape))))
        return out
    t5x_store.Source.read = counting_read

    _, sharded = t5x.from_t5x(path, shardings=shardings)
    for (p, want), got, ref in zip(jax.tree_util.tree_leaves_with_path(shardings),
                                   jax.tree.leaves(sharded), jax.tree.leaves(reference)):
        name = jax.tree_util.keystr(p)
        assert got.sharding == want, (name, got.sharding, want)
        assert len({str(s.index) for s in got.addressable_shards}) == 8, name
        for shard in got.addressable_shards:
            assert shard.data.nbytes * 8 == got.nbytes, (name, shard.data.shape)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref), err_msg=name)
    assert reads and all(n * 8 == total for n, total in reads), sorted(set(reads))
    print("SHARDED_OK", len(reads))
    """
)


def test_sharded_read_on_8_devices_reads_each_device_slice_only(twin):
    env = dict(os.environ)
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-c", _SHARDED, twin["step_dir"]],
        env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0 and "SHARDED_OK" in result.stdout, result.stderr[-5000:]
