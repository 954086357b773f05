"""The cache-effect probe: cached vs fresh forwards along a KV-cached trajectory."""

from __future__ import annotations

import math

import pytest
import torch

from mdm_lens import ArgumentError, HookedMDM, InputError, MDMConfig
from mdm_lens.kvcache import KVCache
from mdm_lens.probes.cache_effect import cache_effect

MASK = 19
PROMPT = torch.tensor([[3, 4, 5, 6, 7]])


def _model(attention_free: bool = False) -> HookedMDM:
    cfg = MDMConfig(d_model=24, n_layers=3, n_heads=4, n_kv_heads=2, d_mlp=16, d_vocab=20, mask_token_id=MASK,
                    n_ctx=40)
    m = HookedMDM.from_config(cfg, seed=11, init_std=0.5)
    with torch.no_grad():
        m.unembed.weight[MASK].zero_()
        if attention_free:  # attention writes nothing: keys/values depend on their own token only
            for b in m.blocks:
                b.attn.o_weight.zero_()
    return m


@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_an_attention_free_model_shows_no_cache_effect(mode):
    """Outside the window the canvas does not change within a block, so with attention writing nothing every
    cached key/value equals the fresh one: zero drift, cosine 1, no change in attention or log-probability."""
    model = _model(attention_free=True)
    out = model.generate(PROMPT, gen_length=8, steps=8, block_length=4, kv_cache=mode)
    t = cache_effect(model, out).table
    assert set(t["step"]) == {1, 2, 3, 5, 6, 7}  # the window steps (0 and 4 refresh)
    by = t.groupby("metric")["value"]
    assert by.max()["k_drift"] <= 1e-6 and by.max()["v_drift"] <= 1e-6
    assert by.min()["k_cosine"] >= 1 - 1e-6 and by.max()["received_tv"] <= 1e-6
    assert by.apply(lambda v: v.abs().max())["patch_logprob"] <= 1e-6
    assert by.apply(lambda v: v.abs().max())["logprob_delta"] <= 1e-6


@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_cached_logprob_is_what_the_cached_forward_computes(mode):
    model = _model()
    out = model.generate(PROMPT, gen_length=8, steps=8, block_length=4, kv_cache=mode)
    effect = cache_effect(model, out, steps=[2])
    t = effect.table
    # the same step through mdm_lens.kvcache: fill at the block start (step 0), window forward at step 2
    x0, x2, total = out.trajectory.x_steps[0], out.trajectory.x_steps[2], out.tokens.shape[1]
    hi = total if mode == "prefix" else 9
    cache = KVCache(model, total)
    with torch.no_grad():
        with cache.attached("fill", (0, total)):
            model(x0)
        if mode == "prefix":
            cache.trim(5)
        with cache.attached(mode, (5, hi)):
            logits = model(x2[:, 5:hi], return_type="aligned", position_ids=torch.arange(5, hi)[None])
        fresh = model(x2, return_type="aligned")
    target = x2[:, 5:hi] == MASK
    lp = torch.log_softmax(logits.double(), -1).gather(-1, out.tokens[:, 5:hi, None])[..., 0][target].mean()
    lp_fresh = torch.log_softmax(fresh.double(), -1).gather(-1, out.tokens[..., None])[..., 0][:, 5:hi][target]
    row = t.set_index(["layer", "metric"])["value"]
    assert math.isclose(row[(-1, "logprob_cached")], float(lp), abs_tol=1e-5)
    assert math.isclose(row[(-1, "logprob_fresh")], float(lp_fresh.mean()), abs_tol=1e-5)
    # layer 0's keys/values depend on their own token only, and outside the window the tokens did not change
    assert row[(0, "k_drift")] <= 1e-6 and row[(1, "k_drift")] > 1e-3
    assert str(t["layer"].dtype) == "Int64" and (t["step"] == 2).all()


def test_undefined_jaccard_is_nan_with_a_reason_and_bad_arguments_are_refused():
    model = _model()
    out = model.generate(PROMPT, gen_length=8, steps=8, block_length=4, kv_cache="dual")
    t = cache_effect(model, out, layers=[2], patch=False).table
    jac = t[t["metric"] == "anchor_jaccard"]
    assert ((jac["value"].isna()) == (jac["reason"] == "no anchors in either forward")).all()
    assert set(t["metric"]) == {"k_drift", "v_drift", "k_cosine", "v_cosine", "received_tv", "anchor_jaccard",
                                "logprob_fresh", "logprob_cached", "logprob_delta"}
    with pytest.raises(InputError, match="has no KV cache"):
        cache_effect(model, model.generate(PROMPT, gen_length=8, steps=8))
    with pytest.raises(ArgumentError, match="layers"):
        cache_effect(model, out, layers=[3])
    with pytest.raises(ArgumentError, match="steps"):
        cache_effect(model, out, steps=[99])


def test_metrics_equal_their_hand_formulas():
    """One window step and layer recomputed by hand: drift = ‖stale − fresh‖ / ‖fresh‖ over the cached positions,
    cosine averaged per position and kv head, TV = ½ Σ |cached − fresh| of the window rows' head-mean attention."""
    model = _model()
    out = model.generate(PROMPT, gen_length=8, steps=8, block_length=4, kv_cache="dual")
    t = cache_effect(model, out, steps=[2], layers=[1], patch=False).table.set_index(["layer", "metric"])["value"]
    x0, x2 = out.trajectory.x_steps[0], out.trajectory.x_steps[2]
    names = [f"blocks.{l}.attn.{h}" for l in range(3) for h in ("hook_rot_k", "hook_v")]
    _, stale = model.run_with_cache(x0, names_filter=lambda n: n in names)
    _, fresh = model.run_with_cache(x2, names_filter=lambda n: n in names + ["blocks.1.attn.hook_pattern"])
    keep = torch.zeros(13, dtype=torch.bool)
    keep[5:9] = True
    for kind, hook in (("k", "hook_rot_k"), ("v", "hook_v")):
        a = stale[f"blocks.1.attn.{hook}"][:, ~keep].double()
        b = fresh[f"blocks.1.attn.{hook}"][:, ~keep].double()
        assert t[(1, f"{kind}_drift")] == pytest.approx(float((a - b).norm() / b.norm()), rel=1e-6)
        cos = (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))
        assert t[(1, f"{kind}_cosine")] == pytest.approx(float(cos.mean()), rel=1e-6)
    stale_hooks = [(n, lambda x, hook: torch.where(keep[None, :, None, None], x, stale[hook.name])) for n in names]
    got = {}
    with torch.no_grad():
        model.run_with_hooks(x2, fwd_hooks=stale_hooks + [("blocks.1.attn.hook_pattern",
                                                           lambda p, hook: got.__setitem__("p", p.clone()))])
    rc = got["p"][:, :, 5:9].double().mean(dim=(1, 2))
    rf = fresh["blocks.1.attn.hook_pattern"][:, :, 5:9].double().mean(dim=(1, 2))
    assert t[(1, "received_tv")] == pytest.approx(float(0.5 * (rc - rf).abs().sum()), rel=1e-5)


def test_two_empty_anchor_sets_are_nan_not_one():
    """With every query weight zero the attention is uniform: no anchor in either forward, so the Jaccard is
    undefined (NaN with the reason), never 1."""
    model = _model()
    with torch.no_grad():
        for b in model.blocks:
            h, e = b.attn.n_heads, b.attn.d_head
            b.attn.qkv_weight[: h * e].zero_()
    out = model.generate(PROMPT, gen_length=8, steps=8, block_length=4, kv_cache="dual")
    t = cache_effect(model, out, patch=False).table
    jac = t[t["metric"] == "anchor_jaccard"]
    assert len(jac) > 0 and jac["value"].isna().all()
    assert (jac["reason"] == "no anchors in either forward").all()
