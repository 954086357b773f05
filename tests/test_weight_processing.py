"""TransformerLens weight processing (`process_weights_`: fold_ln, center_unembed, fold_value_biases) and the TL
attribution helpers in both modes (issue #27 part A).

The bug these tests pin down: TL's cache helpers divide by the cached final scale and then dot with
`tokens_to_residual_directions`, which assumes the final norm's weight is folded into W_U. An unprocessed model
must therefore put `ln_final.w` into the directions; a processed one must not apply it twice. On random models whose
norm weights are 1 both are invisible, so every model here has trained or realistic (log-normal) norm weights.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "families"))

from family_checkpoints import write_llada2, write_lladamoe  # noqa: E402

from mdm_lens import HookedMDM, MDMConfig  # noqa: E402
from mdm_lens.errors import ArgumentError, ConfigError  # noqa: E402

TWINS = ("mdm-lens/tiny-mdm", "mdm-lens/tiny-arm")


def _cfg(**kw) -> MDMConfig:
    base = dict(d_model=48, n_layers=3, n_heads=4, d_mlp=64, d_vocab=61, mask_token_id=60, eos_token_id=1,
                rope_theta=1000.0, norm_eps=1e-6, n_ctx=64)
    return MDMConfig(**{**base, **kw})


def dream_like(seed: int = 3) -> HookedMDM:
    """GQA + q/k/v bias + Dream's logit shift, untied."""
    cfg = _cfg(n_kv_heads=2, qkv_bias=True, logit_shift=True, family="dream", position_policy="cumsum",
               padding_mask="pair")
    return HookedMDM.from_config(cfg, seed=seed, init_std=0.15, init="realistic")


def llada_tied(seed: int = 4) -> HookedMDM:
    """MHA, no bias, tied embeddings (LLaDA-style sampler)."""
    return HookedMDM.from_config(_cfg(tie_word_embeddings=True), seed=seed, init_std=0.15, init="realistic")


@pytest.fixture(scope="module")
def llada2(tmp_path_factory) -> HookedMDM:
    """LLaDA2's layout: GQA, q/k/v bias, output bias, q/k norms, partial rotary, MoE with shared experts."""
    folder = write_llada2(tmp_path_factory.mktemp("llada2") / "m")[0]
    cfg = HookedMDM.from_pretrained(str(folder), load_tokenizer=False).cfg
    return HookedMDM.from_config(cfg, seed=5, init_std=0.1, init="realistic")


def _tokens(model: HookedMDM, shape=(2, 10), seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.cfg.d_vocab - 1, shape, generator=g)


def _copy(model: HookedMDM) -> HookedMDM:
    import copy

    return copy.deepcopy(model)


def _models(llada2):
    return {"tiny-mdm": HookedMDM.from_pretrained(TWINS[0]), "tiny-arm": HookedMDM.from_pretrained(TWINS[1]),
            "dream_like": dream_like(), "llada_tied": llada_tied(), "llada2_moe": llada2}


def _process(model: HookedMDM, **kw) -> HookedMDM:
    m = _copy(model)
    if m.cfg.tie_word_embeddings:
        m.untie_embeddings_()
    return m.process_weights_(**kw)


# --- the realistic fixtures really have non-unit norm weights (otherwise nothing below could fail) ------------
def test_fixtures_have_norm_weights_far_from_one(llada2):
    for name, m in _models(llada2).items():
        dev = (m.ln_final.w - 1).abs().max().item()
        assert dev > 0.2, name


# --- processed logits = unprocessed logits ---------------------------------------------------------------------
@pytest.mark.parametrize("name", ["tiny-mdm", "tiny-arm", "dream_like", "llada_tied", "llada2_moe"])
def test_fold_ln_and_value_biases_keep_the_logits(name, llada2):
    model = _models(llada2)[name]
    tokens = _tokens(model)
    want = model(tokens)
    got = _process(model, fold_ln=True, center_unembed=False, fold_value_biases=True)(tokens)
    scale = float(want.abs().max())
    assert (got - want).abs().max() <= 1e-5 * scale
    assert scale > 0.5  # the comparison is at a meaningful logit scale


@pytest.mark.parametrize("name", ["tiny-mdm", "dream_like", "llada2_moe"])
def test_center_unembed_shifts_each_position_by_one_constant(name, llada2):
    model = _models(llada2)[name]
    tokens = _tokens(model)
    want = model(tokens)
    got = _process(model, fold_ln=True, center_unembed=True, fold_value_biases=True)(tokens)
    shift = got - want
    assert shift.std(dim=-1).max() <= 1e-5 * want.abs().max()
    assert shift.abs().max() > 1e-3  # centring did move the logits (a no-op would pass the line above)
    torch.testing.assert_close(got.log_softmax(-1), want.log_softmax(-1), atol=1e-5, rtol=0)


def test_folded_norms_are_weight_free_and_recorded():
    model = _process(dream_like(), fold_ln=True, center_unembed=False, fold_value_biases=False)
    assert model.cfg.normalization_type == "RMSPre"
    assert model.ln_final.w is None and all(b.ln1.w is None and b.ln2.w is None for b in model.blocks)
    assert dream_like().cfg.normalization_type == "RMS"
    assert model.weight_processing == {"fold_ln": True, "center_unembed": False, "fold_value_biases": False}


def test_fold_ln_planted_values():
    """ln1.w lands in the q/k/v columns, ln_final.w in W_U's rows (d_model side), exactly."""
    model = dream_like()
    w1, wf = model.blocks[0].ln1.w.detach().clone(), model.ln_final.w.detach().clone()
    qkv, u = model.blocks[0].attn.qkv_weight.detach().clone(), model.W_U.detach().clone()
    model.process_weights_(fold_ln=True, center_unembed=False, fold_value_biases=False)
    torch.testing.assert_close(model.blocks[0].attn.qkv_weight, qkv * w1[None, :])
    torch.testing.assert_close(model.W_U, u * wf[:, None])


def test_head_qk_norms_keep_their_weights(llada2):
    before = llada2.blocks[1].attn.q_norm.w.detach().clone()
    m = _process(llada2, fold_ln=True, center_unembed=False, fold_value_biases=False)
    torch.testing.assert_close(m.blocks[1].attn.q_norm.w, before)


def test_hook_normalized_means_the_same_in_both_modes():
    model, tokens = dream_like(), None
    tokens = _tokens(model)
    _, c0 = model.run_with_cache(tokens, names_filter=lambda n: n.endswith(("hook_normalized", "hook_scale")))
    m = _process(model, fold_ln=True, center_unembed=False, fold_value_biases=False)
    _, c1 = m.run_with_cache(tokens, names_filter=lambda n: n.endswith(("hook_normalized", "hook_scale")))
    for key in c0.keys():
        torch.testing.assert_close(c1[key], c0[key], atol=2e-5, rtol=1e-5)


def test_fold_value_biases_moves_b_v_into_b_o_under_gqa():
    model = dream_like()
    attn = model.blocks[1].attn
    b_v, W_O = attn.b_V.detach().clone(), attn.W_O.detach().clone()  # b_V per query head (kv repeated)
    model.process_weights_(fold_ln=False, center_unembed=False, fold_value_biases=True)
    want = torch.einsum("he,hed->d", b_v, W_O)
    torch.testing.assert_close(attn.b_O, want, atol=1e-6, rtol=1e-5)
    assert attn.b_V.abs().max() == 0
    assert want.abs().max() > 1e-2


# --- refusals ------------------------------------------------------------------------------------------------
def test_tied_unembedding_is_refused_until_untied():
    model = llada_tied()
    tokens = _tokens(model)
    want = model(tokens)
    W_E = model.W_E.detach().clone()
    with pytest.raises(ConfigError, match="untie_embeddings_"):
        model.process_weights_()
    assert model.ln_final.w is not None  # the refusal left the model untouched
    model.untie_embeddings_().process_weights_()
    torch.testing.assert_close(model.W_E, W_E)  # the embedding did not move
    torch.testing.assert_close(model(tokens).log_softmax(-1), want.log_softmax(-1), atol=1e-5, rtol=0)
    assert model.cfg.tie_word_embeddings is False


def test_value_bias_folding_is_refused_under_clip_qkv(tmp_path):
    folder = write_lladamoe(tmp_path / "m")[0]
    model = HookedMDM.from_pretrained(str(folder), load_tokenizer=False)
    with pytest.raises(ConfigError, match="clip_qkv"):
        model.process_weights_(fold_value_biases=True)
    model.process_weights_(fold_ln=True, center_unembed=True, fold_value_biases=False)  # the rest is fine


def test_process_weights_validates_its_flags():
    with pytest.raises(ArgumentError, match="fold_ln"):
        dream_like().process_weights_(fold_ln="yes")


def test_from_pretrained_processing_kwargs():
    plain = HookedMDM.from_pretrained_no_processing(TWINS[0])
    assert plain.cfg.normalization_type == "RMS" and plain.ln_final.w is not None
    folded = HookedMDM.from_pretrained(TWINS[0], fold_ln=True)
    assert folded.cfg.normalization_type == "RMSPre"
    tokens = _tokens(plain)
    torch.testing.assert_close(folded(tokens), plain(tokens), atol=1e-5, rtol=1e-5)
    with pytest.raises(ArgumentError):
        HookedMDM.from_pretrained_no_processing(TWINS[0], fold_ln=1)


def test_bf16_model_is_folded_in_fp32():
    cfg = _cfg(n_kv_heads=2, qkv_bias=True, dtype=torch.bfloat16)
    model = HookedMDM.from_config(cfg, seed=1, init_std=0.15, init="realistic")
    ref = model.blocks[0].attn.qkv_weight.float() * model.blocks[0].ln1.w.float()[None]
    model.process_weights_(center_unembed=False, fold_value_biases=False)
    assert model.blocks[0].attn.qkv_weight.dtype == torch.bfloat16
    torch.testing.assert_close(model.blocks[0].attn.qkv_weight.float(), ref.to(torch.bfloat16).float())


# --- attributions sum to the logits in both modes ------------------------------------------------------------
def _dla(model: HookedMDM, tokens: torch.Tensor, answer: torch.Tensor):
    logits, cache = model.run_with_cache(tokens)
    want = logits[torch.arange(tokens.shape[0]), -1, answer]
    return logits, cache, want


@pytest.mark.parametrize("processed", [False, True], ids=["unprocessed", "processed"])
@pytest.mark.parametrize("name", ["tiny-mdm", "tiny-arm", "dream_like", "llada_tied", "llada2_moe"])
def test_attributions_sum_to_the_logits(name, processed, llada2):
    model = _models(llada2)[name]
    if processed:
        model = _process(model)
    tokens = _tokens(model, (3, 9))
    answer = torch.tensor([3, 17, 40])
    logits, cache, want = _dla(model, tokens, answer)
    tol = 1e-4 * float(logits.abs().max())
    # TL's recipe: logit_attrs scales by the cached final norm scale itself
    acc = cache.accumulated_resid(layer=-1, pos_slice=-1)
    torch.testing.assert_close(cache.logit_attrs(acc, tokens=answer, pos_slice=-1)[-1], want, atol=tol, rtol=0)
    parts = cache.decompose_resid(layer=-1, pos_slice=-1)  # embed + every attn_out and mlp_out
    total = cache.logit_attrs(parts, tokens=answer, pos_slice=-1).sum(0)
    torch.testing.assert_close(total, want, atol=tol, rtol=0)
    # the same through apply_ln_to_stack and the directions by hand
    scaled = cache.apply_ln_to_stack(parts, layer=-1, pos_slice=-1)
    by_hand = (scaled * model.tokens_to_residual_directions(answer)).sum(-1).sum(0)
    torch.testing.assert_close(by_hand, want, atol=tol, rtol=0)


@pytest.mark.parametrize("processed", [False, True], ids=["unprocessed", "processed"])
@pytest.mark.parametrize("name", ["tiny-mdm", "dream_like", "llada2_moe"])
def test_full_resid_decomposition_sums_to_the_logits(name, processed, llada2):
    """Heads + MLPs + embed + accumulated bias (b_O, incl. folded value biases) = the final residual."""
    model = _models(llada2)[name]
    if processed:
        model = _process(model)
    model.set_use_attn_result(True)
    tokens = _tokens(model, (2, 8))
    answer = torch.tensor([5, 29])
    logits, cache, want = _dla(model, tokens, answer)
    full = cache.get_full_resid_decomposition(layer=-1, pos_slice=-1, expand_neurons=False)
    final = cache[f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"][:, -1]
    torch.testing.assert_close(full.sum(0), final, atol=1e-4 * float(final.abs().max()), rtol=0)
    attrs = cache.logit_attrs(full, tokens=answer, pos_slice=-1)
    torch.testing.assert_close(attrs.sum(0), want, atol=1e-4 * float(logits.abs().max()), rtol=0)


def test_full_resid_decomposition_with_expanded_neurons():
    model = HookedMDM.from_pretrained(TWINS[0])
    model.set_use_attn_result(True)
    tokens = _tokens(model, (2, 8))
    logits, cache = model.run_with_cache(tokens)
    full = cache.get_full_resid_decomposition(layer=-1, pos_slice=-1, expand_neurons=True)
    final = cache[f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"][:, -1]
    torch.testing.assert_close(full.sum(0), final, atol=1e-4 * float(final.abs().max()), rtol=0)


def test_the_brief_recipe_double_scales_in_tl():
    """`logit_attrs(apply_ln_to_stack(x))` divides by the final scale twice (TL's logit_attrs applies it itself):
    the final entry is the logit divided by the scale. Pinned so the README's recipe stays the working one."""
    model = HookedMDM.from_pretrained(TWINS[0])
    tokens, answer = _tokens(model, (2, 9)), torch.tensor([7, 8])
    _, cache, want = _dla(model, tokens, answer)
    acc = cache.accumulated_resid(layer=-1, pos_slice=-1)
    twice = cache.logit_attrs(cache.apply_ln_to_stack(acc, layer=-1, pos_slice=-1), tokens=answer, pos_slice=-1)
    scale = cache["ln_final.hook_scale"][:, -1, 0]
    torch.testing.assert_close(twice[-1], want / scale, atol=1e-4, rtol=1e-4)
    assert (scale - 1).abs().min() > 0.05  # so the double scaling is visible


def test_unprocessed_directions_include_the_final_norm_weight():
    """The regression: main used W_U alone; the error is large on the trained twin."""
    model = HookedMDM.from_pretrained(TWINS[0])
    answer = torch.tensor([3, 11])
    torch.testing.assert_close(model.tokens_to_residual_directions(answer),
                               model.W_U[:, answer].T * model.ln_final.w)
    tokens = _tokens(model, (2, 9))
    _, cache, want = _dla(model, tokens, answer)
    scaled = cache["ln_final.hook_normalized"][:, -1]
    main_way = (scaled * model.W_U[:, answer].T).sum(-1)
    assert (main_way - want).abs().max() > 0.5


def test_directions_validate_tokens():
    model = dream_like()
    with pytest.raises(ArgumentError, match="tokens"):
        model.tokens_to_residual_directions(torch.tensor([61]))
    with pytest.raises(ArgumentError, match="tokens"):
        model.tokens_to_residual_directions(torch.tensor([1.0]))
    assert model.tokens_to_residual_directions(5).shape == (48,)


def test_accumulated_bias_counts_output_biases(llada2):
    m = _process(llada2, fold_ln=False, center_unembed=False, fold_value_biases=True)
    want = m.blocks[0].attn.b_O + m.blocks[1].attn.b_O
    torch.testing.assert_close(m.accumulated_bias(2), want)
    torch.testing.assert_close(m.accumulated_bias(1, mlp_input=True), want)
    with pytest.raises(ArgumentError, match="layer"):
        m.accumulated_bias(m.cfg.n_layers, mlp_input=True)


# --- the logit lens agrees with the model in both modes --------------------------------------------------------
@pytest.mark.parametrize("processed", [False, True], ids=["unprocessed", "processed"])
def test_logit_lens_final_layer_is_the_models_logits(processed):
    from mdm_lens.lens.logit import lens_logits

    model = HookedMDM.from_pretrained(TWINS[0])
    if processed:
        model = _process(model)
    tokens = _tokens(model, (2, 9))
    logits, cache = model.run_with_cache(tokens)
    final = cache[f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"]
    lens = lens_logits(model, final, model.cfg.n_layers - 1)
    torch.testing.assert_close(lens, model(tokens, return_type="aligned"), atol=1e-5, rtol=1e-5)
    mid = lens_logits(model, cache["blocks.1.hook_resid_post"], 1)  # finite and not the final logits
    assert torch.isfinite(mid).all() and (mid - logits).abs().max() > 1e-2


# --- samplers stay token-exact -------------------------------------------------------------------------------
@pytest.mark.parametrize("sampler", ["llada", "dream"])
def test_samplers_are_token_exact_processed_vs_not(sampler):
    model = HookedMDM.from_pretrained(TWINS[0])
    prompt = torch.tensor([[20, 21, 22, 23, 24, 25]])
    kw = dict(steps=8, gen_length=8, seed=0, temperature=0.7)
    if sampler == "llada":
        kw.update(block_length=8)
    a = model.generate(prompt, sampler=sampler, **kw)
    b = _process(model).generate(prompt, sampler=sampler, **kw)
    assert torch.equal(a.tokens, b.tokens)


def test_the_bridge_refuses_weight_processing():
    """The transformers-native bridge runs transformers' own modules: processing is refused, not half-done."""
    from mdm_lens.bridge.model import TransformersBridge

    with pytest.raises(ConfigError, match="bridge"):
        TransformersBridge.process_weights_(object(), fold_ln=True)
