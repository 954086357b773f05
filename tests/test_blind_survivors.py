"""Tests written for the bugs a held-out auditor planted (without reading tests/) that the suite did not catch:
each test fails under its mutant (tests.mutants --from-json; ids in the test names' docstrings)."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from mdm_lens import HookedMDM, MDMConfig, ReceivedAttention, steps
from mdm_lens.views import step_mapping
from mdm_lens.views.explore_report import _choose_item

MASK = 49


def _model(**kw) -> HookedMDM:
    cfg = MDMConfig(d_model=32, n_layers=2, n_heads=4, d_mlp=48, d_vocab=50, mask_token_id=MASK, n_ctx=64,
                    eos_token_id=1, pad_token_id=0, **kw)
    return HookedMDM.from_config(cfg, seed=2, init_std=0.3)


def test_shifted_loss_does_not_score_the_first_real_position_after_padding():
    """loss-shift-source-self: on a logit-shift model the first real position has no real predecessor."""
    model = _model(logit_shift=True, padding_mask="pair", position_policy="cumsum")
    tokens = torch.tensor([[0, 0, MASK, 7, MASK, 9, MASK]])
    am = torch.tensor([[0, 0, 1, 1, 1, 1, 1]])
    targets = torch.tensor([[0, 0, 5, 7, 8, 9, 10]])
    per = model(tokens, attention_mask=am, return_type="loss", targets=targets, loss_per_token=True)
    assert torch.isnan(per[0, :3]).all()          # pads, and position 2 (read from pad hidden state 1)
    assert torch.isfinite(per[0, [4, 6]]).all()   # masked positions with a real predecessor


def test_both_returns_tl_raw_logits_on_a_shifted_model():
    """model-both-returns-aligned: TL's "both" is (the model's raw logits, loss)."""
    model = _model(logit_shift=True)
    tokens = torch.tensor([[3, MASK, 5, MASK, 8]])
    logits, loss = model(tokens, return_type="both", targets=torch.tensor([[3, 4, 5, 6, 8]]))
    torch.testing.assert_close(logits, model(tokens))
    assert not torch.allclose(logits, model(tokens, return_type="aligned"))
    assert loss.ndim == 0


def test_prompt_query_set_leaves_out_left_pads():
    """reducer-prompt-includes-pads: query="prompt" averages the prompt's real rows only."""
    model = _model()
    prompt = torch.tensor([[0, 0, 4, 5, 6], [2, 3, 4, 5, 6]])
    am = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    out = model.generate(prompt, attention_mask=am, steps=2, gen_length=2, record=[ReceivedAttention(query="prompt")],
                         cache="blocks.1.attn.hook_pattern" @ steps(0))
    pattern = out.cache[0]["blocks.1.attn.hook_pattern"]                    # [batch, head, query, key]
    got = out.records["received_attention"][0, 0, 1]                        # [head, key], row 0 at step 0
    want = pattern[0, :, 2:5].mean(1)                                       # its 3 real prompt rows
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_last_pool_takes_the_last_chosen_position():
    """features-last-is-first."""
    from mdm_lens.lens import features_from_cache

    model = _model()
    out = model.generate(torch.tensor([[2, 3, 4]]), steps=3, gen_length=3,
                         cache="blocks.0.hook_resid_post" @ steps(0, 1))
    chosen = torch.zeros(1, 6, dtype=torch.bool)
    chosen[0, [1, 4]] = True
    feats = features_from_cache(out.cache, layers=[0], pool="last", positions=chosen)
    stream = out.cache.stack("blocks.0.hook_resid_post")                     # [step, batch, pos, d]
    torch.testing.assert_close(feats.acts[0, :, 0], stream[:, 0, 4])
    assert not torch.allclose(feats.acts[0, :, 0], stream[:, 0, 1])


def test_step_mapping_keeps_ends_and_fractions():
    """explore-step-mapping-scale: the last step maps to the other run's last step."""
    assert step_mapping(5, 8, 4) == 7 and step_mapping(4, 10, 3) == 9 and step_mapping(4, 10, 1) == 3
    assert step_mapping(10, 4, 9) == 3 and step_mapping(10, 4, 0) == 0


def test_report_explorer_shows_the_first_shared_item():
    """report-choose-last-common."""
    a = pd.DataFrame({"item_id": ["x", "x", "y", "z"]})
    b = pd.DataFrame({"item_id": ["z", "y", "x"]})
    assert _choose_item([a, b]) == ["x", "x"]
    assert _choose_item([a, pd.DataFrame({"item_id": ["q"]})]) == ["x", "q"]   # nothing shared: each its first


def test_sae_export_of_a_block_run_holds_only_rows_its_forwards_computed(tmp_path):
    """export-uncomputed-rows: an SDAR step computes one block's rows; the others must not be exported as NaN."""
    import numpy as np

    from loss_family_models import family_model
    from mdm_lens.sae import export_activations

    model = family_model("sdar", tmp_path)
    ds = export_activations(model, [[1, 2, 3, 4, 5]], "blocks.1.hook_resid_post", out=tmp_path / "x", gen_length=8,
                            block_length=4, positions="all")
    acts = np.asarray(ds["blocks.1.hook_resid_post"], dtype=np.float64)
    assert ds.num_rows > 0 and np.isfinite(acts).all()


def test_lens_from_a_block_runs_cache_equals_the_replayed_lens(tmp_path):
    """trace-cache-rows-at-0: cached block rows start at their block, not at position 0."""
    from loss_family_models import family_model
    from mdm_lens.lens import lens_trace

    model = family_model("sdar", tmp_path)
    names = [f"blocks.{l}.hook_resid_post" for l in range(model.cfg.n_layers)]
    out = model.generate(torch.tensor([[1, 2, 3, 4, 5]]), gen_length=8, block_length=4, cache=names)
    cached = lens_trace(model, out, source="cache")
    replayed = lens_trace(model, out, source="replay")
    computed = torch.isfinite(cached.final_prob)
    # the cache holds the block rows each forward computed; a replay recomputes the whole prefix (a superset)
    assert computed.any() and bool((torch.isfinite(replayed.final_prob) | ~computed).all())
    torch.testing.assert_close(cached.final_prob[computed], replayed.final_prob[computed], rtol=1e-4, atol=1e-6)
    assert torch.equal(cached.top1[computed], replayed.top1[computed])


def test_block_causal_label_and_gqa_heads_in_repr(tmp_path):
    """config-attention-label-wrong-key, repr-kv-heads."""
    from loss_family_models import family_model

    model = family_model("sdar", tmp_path)
    bl = model.cfg.extra["block_length"]
    assert f"block_length={bl}" in repr(model) and bl is not None
    assert f"heads={model.cfg.n_heads}/{model.cfg.n_key_value_heads}" in repr(model)
    assert model.cfg.n_heads != model.cfg.n_key_value_heads


def test_count_hint_only_when_the_count_really_differs():
    """diagnose-layer-count-offbyone: indices 0..n-1 hold n layers."""
    from mdm_lens.loading.diagnose import _count_hint

    assert _count_hint("layers", "num_hidden_layers", 2, {0, 1}, {"num_hidden_layers": 2}) == ""
    assert _count_hint("layers", "num_hidden_layers", 1, {0}, {"num_hidden_layers": 1}) == ""
    hint = _count_hint("layers", "num_hidden_layers", 3, {0, 1}, {"num_hidden_layers": 3})
    assert "gives 3 layers" in hint and "0..1 (2)" in hint


def test_dream_temperature_none_is_the_references_one():
    """dream-temperature-none-zero: temperature=None resolves to 1.0 (diffusion_generate's legacy default)."""
    cfg = MDMConfig(d_model=16, n_layers=1, n_heads=2, d_mlp=16, d_vocab=20, mask_token_id=19, logit_shift=True,
                    family="dream")
    model = HookedMDM.from_config(cfg)
    out = model.generate(torch.tensor([[1, 2, 3]]), sampler="dream", gen_length=2, steps=2, temperature=None, seed=0)
    assert out.settings["temperature"] == 1.0


def test_foreign_option_passes_only_when_every_owner_ignores_it():
    """registry-neutral-any-owner: top_p=1.0 is not a no-op for every sampler that owns top_p."""
    from mdm_lens.errors import SamplerConfigError

    model = _model()
    with pytest.raises(SamplerConfigError, match="top_p"):
        model.generate(torch.tensor([[1, 2, 3]]), gen_length=2, steps=2, top_p=1.0)
    model.generate(torch.tensor([[1, 2, 3]]), gen_length=2, steps=2, top_p=None)


def test_an_inactive_option_equal_to_its_default_is_accepted(tmp_path):
    """rules-same-identity-only: equal, not identical, to the default (0.85 parsed from text) is the default."""
    from loss_family_models import family_model

    model = family_model("sdar", tmp_path)
    out = model.generate(torch.tensor([[1, 2, 3, 4, 5]]), gen_length=4, block_length=4,
                         remasking_strategy="low_confidence_static", confidence_threshold=float("0.85"))
    assert out.settings["confidence_threshold"] == 0.85


def test_answer_totals_sum_logprobs_and_average_ranks():
    """answer-rank-not-averaged: answer_logprob sums over the answer's tokens, answer_rank is their mean rank."""
    import math

    from mdm_lens.probes._knockout_hooks import _answer_totals

    lp = torch.tensor([[-1.0, -2.0, -4.0], [-0.5, -9.0, -9.0]], dtype=torch.float64)
    rank = torch.tensor([[0.0, 3.0, 6.0], [2.0, 7.0, 7.0]], dtype=torch.float64)
    have = torch.tensor([[True, True, True], [True, False, False]])
    total_lp, mean_rank = _answer_totals(lp, rank, have)
    assert total_lp == pytest.approx((-7.0 + -0.5) / 2) and mean_rank == pytest.approx((3.0 + 2.0) / 2)
    assert all(math.isnan(v) for v in _answer_totals(lp, rank, torch.zeros_like(have)))
