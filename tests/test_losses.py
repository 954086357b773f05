"""`model(tokens, return_type="loss" | "both")`: the masked-diffusion loss (CE of the clean targets at the input's
mask positions, Dream's shifted alignment, LLaDA's 1/p_mask weighting), TL's next-token loss for the ARM twins,
per-token losses with NaN where nothing is scored, padding, and the typed refusals."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from transformer_lens.utilities.lm_utils import lm_cross_entropy_loss

from loss_family_models import FAMILIES, family_getter
from mdm_lens import HookedMDM
from mdm_lens.errors import ArgumentTypeError, InputError, InputTypeError
from mdm_lens.loss import UndefinedLossWarning

B, T = 2, 10


@pytest.fixture(scope="module")
def fam(tmp_path_factory):
    return family_getter(tmp_path_factory.mktemp("loss_families"), seed=3)


def clean_tokens(model, seed=0, shape=(B, T)):
    """Random clean ids that are none of the special ids (mask, pad), so a canvas built from them is unambiguous."""
    c = model.cfg
    avoid = {c.mask_token_id, c.pad_token_id}
    ids = torch.tensor([i for i in range(c.d_vocab) if i not in avoid])
    return ids[torch.randint(0, len(ids), shape, generator=torch.Generator().manual_seed(seed))]


def masked_canvas(model, clean, positions):
    x = clean.clone()
    x[:, positions] = model.cfg.mask_token_id
    return x


def hand_loss(model, x, clean, shift: bool, **kw):
    """F.cross_entropy over the masked positions, logits read from hidden i (or i-1 when `shift`)."""
    with torch.no_grad():
        raw = model(x, **kw).double()
    masked = x == model.cfg.mask_token_id
    if shift:
        masked[:, 0] = False  # no hidden state precedes position 0
        pred = raw[:, :-1][masked[:, 1:]]
    else:
        pred = raw[masked]
    return F.cross_entropy(pred, clean[masked]).item()


# --- planted values ------------------------------------------------------------------------------------------------
def test_uniform_logits_give_log_vocab_and_the_1_over_t_formula(fam):
    model = fam("llada")
    V = model.cfg.d_vocab
    kept = model.unembed.weight.detach().clone()
    with torch.no_grad():
        model.unembed.weight.zero_()  # every logit 0: CE = log V at every scored position, in closed form
    try:
        clean = clean_tokens(model)
        x = masked_canvas(model, clean, [2, 3, 7])
        assert model(x, return_type="loss", targets=clean).item() == pytest.approx(math.log(V), rel=1e-6)
        # LLaDA pre-training: Σ_masked CE / p  over B·L  =  B·3·log V / p / (B·T)
        p = 0.25
        got = model(x, return_type="loss", targets=clean, weighting="1/t", p_mask=p).item()
        assert got == pytest.approx(3 * math.log(V) / p / T, rel=1e-6)
        # one rate per row: (3 log V / 0.5 + 3 log V / 0.1) / (2 T)
        got = model(x, return_type="loss", targets=clean, weighting="1/t", p_mask=torch.tensor([0.5, 0.1])).item()
        assert got == pytest.approx((3 * math.log(V) / 0.5 + 3 * math.log(V) / 0.1) / (2 * T), rel=1e-6)
        per = model(x, return_type="loss", targets=clean, loss_per_token=True, weighting="1/t", p_mask=p)
        assert torch.allclose(per[:, [2, 3, 7]], torch.full((B, 3), math.log(V) / p))
    finally:
        with torch.no_grad():
            model.unembed.weight.copy_(kept)


@pytest.mark.parametrize("name", FAMILIES)
def test_loss_is_masked_cross_entropy_of_the_aligned_logits(fam, name):
    model = fam(name)
    clean = clean_tokens(model, seed=1)
    x = masked_canvas(model, clean, [1, 4, 5, 9])
    got = model(x, return_type="loss", targets=clean)
    want = hand_loss(model, x, clean, shift=model.cfg.logit_shift)
    assert got.item() == pytest.approx(want, rel=1e-5)
    assert got.item() > 0.5  # a realistic random model is far from certain: the check is not 0 == 0


@pytest.mark.parametrize("name", ["dream", "fastdllm_v2"])
def test_shifted_families_read_hidden_i_minus_1(fam, name):
    """A mutant that forgets the shift (scores raw logit i against token i) gives another number."""
    model = fam(name)
    assert model.cfg.logit_shift
    clean = clean_tokens(model, seed=2)
    x = masked_canvas(model, clean, [3, 6, 8])
    got = model(x, return_type="loss", targets=clean).item()
    assert got == pytest.approx(hand_loss(model, x, clean, shift=True), rel=1e-5)
    assert abs(got - hand_loss(model, x, clean, shift=False)) > 1e-2
    # position 0 has no predecessor: masked there, it is not scored (NaN), and the rest still is
    x0 = masked_canvas(model, clean, [0, 3])
    per = model(x0, return_type="loss", targets=clean, loss_per_token=True)
    assert torch.isnan(per[:, 0]).all() and torch.isfinite(per[:, 3]).all()


def test_twin_mdm_loss_and_both(mdm):
    clean = clean_tokens(mdm, seed=4)
    x = masked_canvas(mdm, clean, [2, 5, 6])
    logits, loss = mdm(x, return_type="both", targets=clean)
    assert torch.equal(logits, mdm(x)) and loss.ndim == 0
    assert loss.item() == pytest.approx(hand_loss(mdm, x, clean, shift=False), rel=1e-5)
    raw, aligned = mdm(x, return_type="raw_and_aligned")
    assert torch.equal(raw, logits) and torch.equal(aligned, logits)  # the twin is unshifted


# --- what is scored ------------------------------------------------------------------------------------------------
def test_only_masked_positions_are_scored(fam):
    model = fam("llada2")
    clean = clean_tokens(model, seed=5)
    x = masked_canvas(model, clean, [2, 7])
    base = model(x, return_type="loss", targets=clean, loss_per_token=True)
    assert torch.equal(torch.isfinite(base), x == model.cfg.mask_token_id)
    other = clean.clone()
    other[:, [0, 4, 9]] = (other[:, [0, 4, 9]] + 1) % 90  # targets at unmasked positions: no effect
    assert torch.equal(model(x, return_type="loss", targets=other, loss_per_token=True).nan_to_num(-1),
                       base.nan_to_num(-1))
    moved = clean.clone()
    moved[:, 7] = (moved[:, 7] + 1) % 90  # a target at a masked position: changes that position only
    per = model(x, return_type="loss", targets=moved, loss_per_token=True)
    assert torch.equal(per[:, 2], base[:, 2]) and not torch.allclose(per[:, 7], base[:, 7])


def test_no_masked_position_is_nan_with_a_reason(fam):
    model = fam("sdar")
    clean = clean_tokens(model, seed=6)
    with pytest.warns(UndefinedLossWarning, match="no position of the input is the mask token"):
        loss = model(clean, return_type="loss", targets=clean)
    assert torch.isnan(loss)
    per = model(clean, return_type="loss", targets=clean, loss_per_token=True)
    assert per.shape == (B, T) and torch.isnan(per).all()


def test_padding_is_never_scored_and_leaves_the_real_rows_alone(fam):
    model = fam("llada")
    clean = clean_tokens(model, seed=7)
    x = masked_canvas(model, clean, [1, 3, 6])
    am = torch.ones(B, T, dtype=torch.long)
    am[1, 5:] = 0  # right padding: row 1 has 5 real tokens
    x_pad, clean_pad = x.clone(), clean.clone()
    x_pad[1, 5:] = clean_pad[1, 5:] = model.cfg.pad_token_id
    per = model(x_pad, attention_mask=am, return_type="loss", targets=clean_pad, loss_per_token=True)
    assert torch.isnan(per[1, 5:]).all() and torch.isfinite(per[1, [1, 3]]).all()
    alone = model(x[1:, :5], return_type="loss", targets=clean[1:, :5], loss_per_token=True)
    torch.testing.assert_close(per[1:, :5], alone, rtol=1e-5, atol=1e-6, equal_nan=True)
    loss = model(x_pad, attention_mask=am, return_type="loss", targets=clean_pad)
    assert loss.item() == pytest.approx(per[~per.isnan()].mean().item(), rel=1e-6)  # 5 scored positions
    # 1/t: the denominator counts real positions only (T + 5), not the padded T·B
    weighted = model(x_pad, attention_mask=am, return_type="loss", targets=clean_pad, weighting="1/t", p_mask=0.5)
    assert weighted.item() == pytest.approx((per[~per.isnan()] / 0.5).sum().item() / (T + 5), rel=1e-6)


# --- autoregressive twins ------------------------------------------------------------------------------------------
def test_arm_loss_is_tl_next_token_loss(arm):
    tokens = clean_tokens(arm, seed=8, shape=(B, 12))
    logits, loss = arm(tokens, return_type="both")
    assert loss.item() == pytest.approx(lm_cross_entropy_loss(logits, tokens).item(), rel=1e-6)
    per = arm(tokens, return_type="loss", loss_per_token=True)
    assert per.shape == (B, 11)
    torch.testing.assert_close(per, lm_cross_entropy_loss(logits, tokens, per_token=True), rtol=1e-6, atol=1e-6)
    am = torch.ones_like(tokens)
    am[0, 8:] = 0
    padded = tokens.masked_fill(am == 0, arm.cfg.pad_token_id)
    with torch.no_grad():
        logits = arm(padded, attention_mask=am)
    got = arm(padded, attention_mask=am, return_type="loss")
    assert got.item() == pytest.approx(lm_cross_entropy_loss(logits, padded, attention_mask=am).item(), rel=1e-6)
    per = arm(padded, attention_mask=am, return_type="loss", loss_per_token=True)
    assert torch.isnan(per[0, 7:]).all() and torch.isfinite(per[0, :7]).all()  # pairs touching a pad: NaN, not 0
    with pytest.warns(UndefinedLossWarning, match="two real tokens"):
        assert torch.isnan(arm(tokens[:, :1], return_type="loss"))


# --- refusals ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, error, match", [
    (dict(return_type="loss"), InputError, "needs targets="),
    (dict(return_type="loss", targets="abc"), InputTypeError, "targets"),
    (dict(return_type="loss", targets=torch.zeros(B, T)), InputTypeError, "dtype"),
    (dict(return_type="loss", targets=torch.zeros(B, T + 1, dtype=torch.long)), InputError, "shape"),
    (dict(return_type="loss", targets=torch.full((B, T), 97)), InputError, r"\[0, 97\)"),
    (dict(return_type="loss", targets=torch.full((B, T), 95)), InputError, "mask token id 95"),
    (dict(return_type="logits", targets=torch.zeros(B, T, dtype=torch.long)), InputError, "only used with"),
    (dict(return_type="aligned", loss_per_token=True), InputError, "only used with"),
    (dict(return_type="loss", weighting="1/t"), InputError, "p_mask"),
    (dict(return_type="loss", p_mask=0.5), InputError, "p_mask"),
    (dict(return_type="loss", weighting="1/t", p_mask=0.0), InputError, r"\(0, 1\]"),
    (dict(return_type="loss", weighting="1/t", p_mask=torch.ones(3)), InputError, "shape"),
    (dict(return_type="loss", weighting="t"), InputError, "weighting"),
    (dict(return_type="loss", loss_per_token=1), ArgumentTypeError, "loss_per_token"),
])
def test_bad_loss_arguments_raise_typed_errors(fam, kwargs, error, match):
    model = fam("llada")  # mask id 95, vocabulary 97
    clean = clean_tokens(model)
    x = masked_canvas(model, clean, [2])
    if "targets" not in kwargs and kwargs["return_type"] == "loss" and "needs targets" not in match:
        kwargs = {**kwargs, "targets": clean}
    with pytest.raises(error, match=match):
        model(x, **kwargs)


def test_arm_refuses_the_diffusion_weighting(arm):
    with pytest.raises(InputError, match="next-token"):
        arm(torch.tensor([[5, 6, 7]]), return_type="loss", weighting="1/t", p_mask=0.5)


def test_mdm_without_mask_id_refuses_a_loss(fam):
    cfg = fam("llada").cfg
    import dataclasses

    model = HookedMDM.from_config(dataclasses.replace(cfg, mask_token_id=None), seed=0, init="realistic")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(InputError, match="mask_token_id"):
            model(torch.tensor([[5, 6]]), return_type="loss", targets=torch.tensor([[5, 6]]))
