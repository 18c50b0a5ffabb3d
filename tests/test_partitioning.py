"""Tests for distillspec.partitioning: rules, divisibility fallback, and an 8-device run."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from distillspec import partitioning

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Only mesh.shape is read when mapping specs, so an abstract 4 x 2 mesh tests the mapping
# without 8 devices.
MESH_4x2 = AbstractMesh((4, 2), ("data", "model"))


@pytest.mark.parametrize(
    "logical, shape, want",
    [
        (P("layers", "embed", "mlp"), (2, 32, 64), P(None, None, "model")),
        (P("layers", "mlp", "embed"), (2, 64, 32), P(None, "model", None)),
        (P("layers", "embed", "heads", "kv"), (2, 32, 4, 8), P(None, None, "model", None)),
        (P("layers", "embed", "kv_heads", "kv"), (2, 32, 2, 8), P(None, None, None, None)),
        (P("vocab", "embed"), (64, 32), P("model", None)),
        (P("embed", "vocab"), (32, 64), P(None, "model")),
        (P("batch", "length"), (8, 12), P("data", None)),
        # 63 rows do not split two ways: that dimension falls back to replication.
        (P("vocab", "embed"), (63, 32), P(None, None)),
    ],
)
def test_default_rules(logical, shape, want):
    assert partitioning.logical_to_mesh_spec(logical, MESH_4x2, shape=shape) == want


def test_unknown_logical_axis_raises():
    with pytest.raises(ValueError, match="'emebd'.*no partitioning rule"):
        partitioning.logical_to_mesh_spec(P("emebd", "mlp"), MESH_4x2)


def test_make_mesh_checks_device_count():
    n = len(jax.devices())
    with pytest.raises(ValueError, match=f"data=2 x model=3 = 6 devices, but {n} are available"):
        partitioning.make_mesh(2, 3)
    mesh = partitioning.make_mesh(n, 1)
    assert mesh.axis_names == ("data", "model") and mesh.shape["data"] == n


def test_shardings_for_rank_mismatch_raises():
    mesh = partitioning.make_mesh(len(jax.devices()), 1)
    params = {"w": np.zeros((4, 4))}
    with pytest.raises(ValueError, match=r"\['w'\] has shape \(4, 4\)"):
        partitioning.shardings_for(params, {"w": P("embed")}, mesh)


def test_shard_batch_checks_divisibility():
    mesh = partitioning.make_mesh(len(jax.devices()), 1)
    batch = partitioning.shard_batch({"x": np.ones((4, 3)), "n": np.int32(2)}, mesh)
    assert batch["x"].sharding == partitioning.batch_sharding(mesh)
    assert batch["n"].sharding == partitioning.replicated(mesh)


_MULTI_DEVICE = textwrap.dedent(
    """
    import jax, numpy as np
    jax.config.update("jax_disable_most_optimizations", True)
    from jax.sharding import PartitionSpec as P
    from distillspec import partitioning as pt
    from distillspec.checkpoints import Checkpointer
    from distillspec.models import DecoderOnlyLM, TransformerConfig

    assert len(jax.devices()) == 8, jax.devices()
    model = DecoderOnlyLM(TransformerConfig(vocab_size=64, embed_dim=32, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64))
    params = model.init(jax.random.PRNGKey(0))
    tokens = np.random.RandomState(0).randint(0, 64, (8, 12)).astype(np.int32)
    logits = jax.jit(model.logits)
    ref = np.asarray(logits(jax.device_put(params, jax.devices()[0]),
                            {"decoder_input_tokens": tokens}))

    def place(data, model_size):
        mesh = pt.make_mesh(data, model_size)
        shardings = pt.shardings_for(params, model.logical_axes(), mesh)
        return mesh, jax.device_put(params, shardings)

    mesh, sharded = place(4, 2)
    layers = sharded["layers"]
    assert layers["mlp"]["wi_0"]["kernel"].sharding.spec == P(None, None, "model")
    assert layers["mlp"]["wi_0"]["kernel"].addressable_shards[0].data.shape == (2, 32, 32)
    assert layers["mlp"]["wo"]["kernel"].sharding.spec == P(None, "model", None)
    assert layers["attn"]["q"]["kernel"].sharding.spec == P(None, None, "model", None)
    assert layers["attn"]["k"]["kernel"].sharding.spec == P(None, None, None, None)
    assert sharded["embed"]["embedding"].sharding.spec == P("model", None)
    assert sharded["lm_head"]["kernel"].sharding.spec == P(None, "model")
    batch = pt.shard_batch({"decoder_input_tokens": tokens}, mesh)
    out = logits(sharded, batch)
    assert out.sharding.spec[0] == "data", out.sharding
    np.testing.assert_allclose(np.asarray(out), ref, atol=1e-5, rtol=1e-5)

    # 1 x 8: 4 heads do not split 8 ways, so q/o fall back to replication; mlp (64) splits.
    mesh8, sharded8 = place(1, 8)
    assert sharded8["layers"]["attn"]["q"]["kernel"].sharding.spec == P(None, None, None, None)
    assert sharded8["layers"]["mlp"]["wi_0"]["kernel"].sharding.spec == P(None, None, "model")
    out8 = logits(sharded8, pt.shard_batch({"decoder_input_tokens": tokens}, mesh8))
    np.testing.assert_allclose(np.asarray(out8), ref, atol=1e-5, rtol=1e-5)

    # Checkpoints restore into the template's shardings, here a different mesh (resharding).
    import sys
    with Checkpointer(sys.argv[1]) as ckpt:
        ckpt.save(1, {"params": sharded})
        step, restored = ckpt.restore_latest({"params": sharded8})
    for want, got in zip(jax.tree.leaves(sharded8), jax.tree.leaves(restored["params"])):
        assert got.sharding == want.sharding, (got.sharding, want.sharding)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    print("MULTI_DEVICE_OK")
    """
)


def test_multi_device_sharded_forward_matches_single_device(tmp_path):
    env = dict(os.environ)
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-c", _MULTI_DEVICE, str(tmp_path)],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0 and "MULTI_DEVICE_OK" in result.stdout, result.stderr[-5000:]


_FSDP = textwrap.dedent(
    """
    import sys
    import jax, numpy as np
    jax.config.update("jax_disable_most_optimizations", True)
    from distillspec import partitioning as pt
    from distillspec.models import DecoderOnlyLM, TransformerConfig, from_pretrained
    from distillspec.models import save_pretrained

    assert len(jax.devices()) == 8, jax.devices()
    # The tiny teacher of configs/tests/tiny_distill.gin.
    teacher = DecoderOnlyLM(TransformerConfig(vocab_size=260, embed_dim=32, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64, init_std=0.5))
    rng = jax.random.PRNGKey(1)
    whole = teacher.init(rng)
    total = sum(x.nbytes for x in jax.tree.leaves(whole))

    def per_device(params):
        held = pt.bytes_per_device(params)
        assert len(held) == 8, held
        return np.array(list(held.values())) / total

    # 8 x 1 with FSDP: every parameter has an 'embed' dimension (32), split 8 ways.
    mesh = pt.make_mesh(8, 1)
    sharded = pt.init_sharded(teacher, rng, mesh, pt.FSDP_RULES)
    np.testing.assert_allclose(per_device(sharded), 1 / 8, rtol=1e-6)
    for leaf in jax.tree.leaves(sharded):
        assert "data" in leaf.sharding.spec, leaf.sharding
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(sharded), jax.device_get(whole))
    # Without FSDP the same mesh replicates everything (data parallelism).
    np.testing.assert_allclose(per_device(pt.init_sharded(teacher, rng, mesh)), 1.0)

    # 4 x 2: 'embed' over data and heads / mlp / vocab over model; K/V and norms are only
    # split 4 ways, so slightly more than 1/8 per device.
    mesh = pt.make_mesh(4, 2)
    sharded = pt.init_sharded(teacher, rng, mesh, pt.FSDP_RULES)
    share = per_device(sharded)
    assert np.all(share >= 1 / 8) and np.all(share < 1.2 / 8), share
    tokens = np.random.RandomState(0).randint(0, 260, (8, 12)).astype(np.int32)
    batch = pt.shard_batch({"decoder_input_tokens": tokens}, mesh)
    ref = np.asarray(jax.jit(teacher.logits)(whole, {"decoder_input_tokens": tokens}))
    out = np.asarray(jax.jit(teacher.logits)(sharded, batch))
    np.testing.assert_allclose(out, ref, atol=1e-4, rtol=1e-4)

    # A Hugging Face checkpoint loads straight into the same shardings.
    save_pretrained(teacher, whole, sys.argv[1])
    place = lambda model, shapes: pt.shardings_for(shapes, model.logical_axes(), mesh,
                                                   pt.FSDP_RULES)
    _, loaded = from_pretrained(sys.argv[1], shardings=place)
    for want, got in zip(jax.tree.leaves(sharded), jax.tree.leaves(loaded)):
        assert got.sharding == want.sharding, (got.sharding, want.sharding)
    np.testing.assert_allclose(per_device(loaded), share)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(loaded), jax.device_get(whole))
    print("FSDP_OK")
    """
)


def test_fsdp_puts_an_eighth_of_the_teacher_on_each_of_8_devices(tmp_path):
    env = dict(os.environ)
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-c", _FSDP, str(tmp_path / "hf")],
        env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0 and "FSDP_OK" in result.stdout, result.stderr[-5000:]


def test_fsdp_rules_split_embed_over_data():
    assert partitioning.param_rules(False) == partitioning.DEFAULT_RULES
    spec = partitioning.logical_to_mesh_spec(
        P("layers", "embed", "mlp"), MESH_4x2, partitioning.FSDP_RULES, shape=(2, 32, 64)
    )
    assert spec == P(None, "data", "model")
    # 'vocab' takes 'model' first; 'embed' then takes 'data'.
    spec = partitioning.logical_to_mesh_spec(
        P("vocab", "embed"), MESH_4x2, partitioning.FSDP_RULES, shape=(64, 32)
    )
    assert spec == P("model", "data")


def test_data_shards_in_one_process():
    mesh = partitioning.make_mesh(len(jax.devices()), 1)
    assert partitioning.data_shards(mesh, 8) == (1, [0])
    assert partitioning.data_shards(None, 8, 4) == (4, [0, 1, 2, 3])
    assert partitioning.process_rows(None, 8) == (0, 8)
    with pytest.raises(ValueError, match=r"data_shards \(3\) must be a multiple .* divide"):
        partitioning.data_shards(None, 8, 3)
