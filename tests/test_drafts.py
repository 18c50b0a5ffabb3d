"""A fresh draft's size is chosen relative to its target (`models.drafts.fresh_sizes`)."""

from __future__ import annotations

import pytest

from distillspec.models import T5LM, DecoderOnlyLM, T5Config, TransformerConfig
from distillspec.models.drafts import DraftSpec, make_draft, num_params

# A user's Llama target (issue 26): 4 layers x 256, a 6,000-id BPE vocabulary.
LLAMA_4X256 = TransformerConfig(vocab_size=6000, embed_dim=256, num_layers=4, num_heads=4,
                                num_kv_heads=4, head_dim=64, mlp_dim=688)  # fmt: skip
# The embedded default's target (configs/models/code_target.gin): 2.75 M parameters.
EMBEDDED = TransformerConfig(vocab_size=2048, embed_dim=256, num_layers=2, num_heads=4,
                             num_kv_heads=4, head_dim=64, mlp_dim=768)  # fmt: skip


def _share(spec: DraftSpec, target) -> tuple[float, object]:
    draft, _ = make_draft(spec, target, None)
    return num_params(draft) / num_params(target), draft


def test_default_draft_of_a_4x256_llama_is_under_a_quarter_of_its_parameters():
    share, draft = _share(DraftSpec(), DecoderOnlyLM(LLAMA_4X256))
    assert share <= 0.25 and share <= 0.1
    assert draft.config.num_layers == 1 and draft.config.vocab_size == 6000
    assert draft.config.num_heads * draft.config.head_dim == draft.config.embed_dim


def test_default_draft_of_the_embedded_target_is_under_a_tenth():
    share, _ = _share(DraftSpec(), DecoderOnlyLM(EMBEDDED))
    assert share <= 0.1


def test_the_widest_width_within_the_budget_is_taken():
    target = DecoderOnlyLM(EMBEDDED)
    share, draft = _share(DraftSpec(max_param_fraction=0.2), target)
    assert share <= 0.2 and draft.config.embed_dim == 64  # 128 wide would be 0.38.
    wider = TransformerConfig(**{**draft.config.__dict__, "embed_dim": 128, "mlp_dim": 384})
    assert num_params(DecoderOnlyLM(wider)) > 0.2 * num_params(target)


def test_sizes_set_by_the_user_are_kept():
    _, draft = _share(DraftSpec(num_layers=2, embed_dim=64), DecoderOnlyLM(LLAMA_4X256))
    assert (draft.config.num_layers, draft.config.embed_dim) == (2, 64)
    assert draft.config.mlp_dim == round(688 * 64 / 256)  # Scaled with the width.


def test_t5_target_gets_a_smaller_encoder_and_decoder():
    config = T5Config(vocab_size=512, embed_dim=128, num_encoder_layers=4, num_decoder_layers=4,
                      num_heads=4, head_dim=32, mlp_dim=256)  # fmt: skip
    target = T5LM(config)
    share, draft = _share(DraftSpec(), target)
    assert share <= 0.1 and draft.config.num_encoder_layers == 1


@pytest.mark.parametrize("bad", [0, 1, 1.5, -0.1, "0.1"])
def test_bad_fraction_is_named(bad):
    with pytest.raises(ValueError, match="DraftSpec.max_param_fraction must be in"):
        DraftSpec(max_param_fraction=bad)
