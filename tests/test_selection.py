"""AdaSPEC's token selection (`distillspec.selection`) on cases whose hard tokens are known.

A hard token is one the reference model (distilled toward the target) could not fit either:
its loss there is as large as the draft's, so Delta L = L_draft - L_ref is small and AdaSPEC
drops it; an easy token is one the reference fits and the draft does not yet (Delta L large).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from distillspec import losses, selection, trainer
from tests import test_heads as h

V = 9


def _case(seed=0, rows=3, length=8):
    """Target logits, a draft uniform everywhere, and a reference equal to the target except
    at the known hard tokens, where it is uniform too; weights with some tokens masked."""
    rng = np.random.default_rng(seed)
    target = rng.normal(size=(rows, length, V)).astype(np.float32) * 3
    draft = np.zeros_like(target)
    hard = rng.random((rows, length)) < 0.5
    reference = np.where(hard[..., None], 0.0, target).astype(np.float32)
    weights = (rng.random((rows, length)) < 0.8).astype(np.float32)
    return target, draft, reference, hard, weights


@pytest.mark.parametrize("kind", ["fkl", "lk_alpha", "tvd"])
def test_the_selection_keeps_exactly_the_tokens_the_reference_fits(kind):
    target, draft, reference, hard, weights = _case()
    draft_loss = losses.token_divergence(draft, target, weights, kind)
    reference_loss = losses.token_divergence(reference, target, weights, kind)
    easy = (~hard) & (weights > 0)
    fraction = easy.sum() / (weights > 0).sum()  # As many tokens as there are easy ones.
    kept = np.asarray(selection.select_tokens(draft_loss, reference_loss, weights, fraction))
    np.testing.assert_array_equal(kept > 0, easy)
    np.testing.assert_array_equal(kept[easy], weights[easy])  # The weights themselves, kept.


def test_the_selection_ranks_by_the_gap_over_the_whole_batch():
    draft_loss = np.array([[5.0, 1.0, 4.0, 9.0], [2.0, 3.0, 0.5, 7.0]], np.float32)
    reference_loss = np.array([[4.9, 0.0, 1.0, 9.0], [0.0, 0.0, 0.0, 0.0]], np.float32)
    weights = np.array([[1, 1, 1, 1], [1, 1, 1, 0]], np.float32)  # The 7.0 is padding.
    # Gaps: 0.1, 1, 3, 0 | 2, 3, 0.5, (masked): the top 3 of 7 (ceil(0.4 x 7)) are 3, 3, 2.
    kept = selection.select_tokens(draft_loss, reference_loss, weights, 0.4)
    np.testing.assert_array_equal(kept, [[0, 0, 1, 0], [1, 1, 0, 0]])
    everything = selection.select_tokens(draft_loss, reference_loss, weights, 1.0)
    np.testing.assert_array_equal(everything, weights)
    nothing = selection.select_tokens(draft_loss, reference_loss, 0 * weights, 0.4)
    assert float(jnp.sum(nothing)) == 0.0
    with pytest.raises(ValueError, match=r"fraction must be in \(0, 1\], got 0"):
        selection.select_tokens(draft_loss, reference_loss, weights, 0)


def test_the_train_step_trains_on_the_selected_tokens_and_reports_acceptance_on_all():
    params, teacher_params = (
        h.STUDENT.init(jax.random.PRNGKey(0)),
        h.TEACHER.init(jax.random.PRNGKey(1)),
    )
    reference = h.STUDENT.init(jax.random.PRNGKey(2))
    batch = {k: v for k, v in h.make_batch().items() if k not in ("log_probs", "ids")}
    sums = {}
    for name, fraction, ref in (("all", 1.0, None), ("selected", 0.4, reference)):
        loss = trainer.LossConfig(divergence="fkl", select_fraction=fraction)
        step = trainer.compile_train_step(h.STUDENT, h.TEACHER, loss, h._gradient_store())
        state = trainer.init_state(jax.tree.map(jnp.copy, params), h._gradient_store())
        sums[name] = jax.device_get(step(state, teacher_params, batch, None, ref)[1])
    total = float(sums["all"]["weight_sum"])
    assert float(sums["selected"]["metric_weight_sum"]) == total
    assert float(sums["selected"]["weight_sum"]) == np.ceil(0.4 * total)
    # The acceptance metric counts every token, as without selection.
    assert float(sums["selected"]["acceptance_sum"]) == pytest.approx(
        float(sums["all"]["acceptance_sum"]), rel=1e-6
    )
    record = trainer.host_metrics(sums["selected"], 1e-3, 1.0)
    assert record["selected_fraction"] == pytest.approx(np.ceil(0.4 * total) / total)
    assert record["acceptance_proxy"] == pytest.approx(
        float(sums["all"]["acceptance_sum"]) / total, rel=1e-6
    )


@pytest.mark.parametrize("value", [0.0, 1.5, -0.1])
def test_loss_config_rejects_a_selected_fraction_outside_0_1(value):
    with pytest.raises(ValueError, match=r"LossConfig.select_fraction must be in \(0, 1\]"):
        trainer.LossConfig(select_fraction=value)


def test_loss_config_takes_the_lk_losses_and_rejects_a_negative_eta():
    for kind in ("lk_alpha", "lk_lambda", "lk_lambda_mean"):
        assert trainer.LossConfig(divergence=kind, eta=2.0).eta == 2.0
    with pytest.raises(ValueError, match="LossConfig.eta must be >= 0, got -1"):
        trainer.LossConfig(divergence="lk_lambda", eta=-1)
