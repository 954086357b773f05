"""Fast-dLLM's block decoding of Dream (`kv_cache=`, `block_length=`, `threshold=`): trajectories token-exact
against a transcription of NVlabs/Fast-dLLM @ 24cc59e `dream/model/generation_utils_block.py` `_sample`, its cached
model emulated by hook substitution of the block-start keys/values (proven equal to the cache in
tests/test_kv_cache.py). Token sampling uses `mdm_lens.diffusion.dream.sample_tokens` (tested against Dream's own
in tests/test_sampler_reference.py) with the run's generator; the loop around it is transcribed here."""

from __future__ import annotations

import pytest
import torch

from mdm_lens import HookedMDM, MDMConfig, SamplerConfigError
from mdm_lens.diffusion.dream import sample_tokens
from sampler_rigs import identity_unembed, no_mask_hooks

MASK = 19
NO_MASK = no_mask_hooks(MASK)
PROMPT = torch.tensor([[3, 4, 5, 6, 7]])




@pytest.fixture(scope="module")
def model():
    cfg = MDMConfig(d_model=24, n_layers=2, n_heads=4, n_kv_heads=2, d_mlp=16, d_vocab=20, mask_token_id=MASK,
                    n_ctx=40, logit_shift=True, position_policy="cumsum", padding_mask="pair")
    m = HookedMDM.from_config(cfg, seed=5, init_std=0.6)
    return identity_unembed(m)


def _kv_names(model):
    return [f"blocks.{i}.attn.{h}" for i in range(model.cfg.n_layers) for h in ("hook_rot_k", "hook_v")]


def _raw(model, x, stale=None, keep=None):
    """Raw (unshifted) logits; with `stale`, keys/values outside `keep` are the block-start ones."""
    hooks = list(NO_MASK)
    if stale is not None:
        def put(t, hook):
            return torch.where(keep[None, :, None, None], t, stale[hook.name])
        hooks += [(n, put) for n in _kv_names(model)]
    return model.run_with_hooks(x, return_type="logits", fwd_hooks=hooks)


def _shift(logits):
    return torch.cat([logits[:, :1], logits[:, :-1]], dim=1)


def reference(model, prompt, gen_length, steps, block_length, dual, threshold, temperature, top_p, top_k, alg_temp,
              eps, g):
    x = torch.cat([prompt, torch.full((prompt.shape[0], gen_length), MASK)], dim=1)
    n_blocks = gen_length // block_length
    spb = steps // n_blocks
    ts = torch.linspace(1, eps, spb + 1)
    total, p0, nfe = x.shape[1], prompt.shape[1], 0
    for b in range(n_blocks):
        lo, hi = p0 + b * block_length, p0 + (b + 1) * block_length
        _, cache = model.run_with_cache(x, names_filter=lambda n: n.endswith(("hook_rot_k", "hook_v")))
        stale = {n: cache[n].clone() for n in _kv_names(model)}
        logits = _shift(_raw(model, x))
        nfe += 1
        conf, x0 = sample_tokens(logits.reshape(-1, 20), temperature, top_p, top_k, generator=g)
        x[:, lo] = x0.view(x.shape)[:, lo]
        keep = torch.zeros(total, dtype=torch.bool)
        w_hi = hi if dual else total
        keep[lo:w_hi] = True
        i = 1
        while True:
            mask_index = x[:, lo:w_hi] == MASK
            logits = _shift(_raw(model, x, stale, keep)[:, lo:w_hi])
            nfe += 1
            if threshold is not None:
                c, x0 = sample_tokens(logits[mask_index], temperature, top_p, top_k, generator=g)
                x_ = torch.full_like(x[:, lo:w_hi], MASK)
                full = torch.full(x_.shape, -torch.inf)
                x_[mask_index] = x0
                full[mask_index] = c
                full[:, block_length:] = -torch.inf
                n = int((x[:, lo:hi] == MASK).sum())
                sel_conf, sel = torch.topk(full, n)
                t_idx = torch.zeros_like(x_, dtype=torch.bool)
                t_idx[0, sel[0]] = True
                for k in range(1, n):
                    if sel_conf[0, k] < threshold:
                        t_idx[0, sel[0, k]] = False
                x[:, lo:w_hi][t_idx] = x_[t_idx]
            else:
                if i == spb:
                    break
                t, s = ts[i], ts[i + 1]
                mask_index[:, block_length:] = False
                c, x0 = sample_tokens(logits[mask_index], temperature, top_p, top_k, neg_entropy=True, generator=g)
                num = mask_index.sum() / mask_index.shape[0]
                k = int(num * (1 - s / t)) if i < spb - 1 else int(num)
                full = torch.full(x[:, lo:w_hi].shape, -torch.inf)
                full[mask_index] = c
                full[:, block_length:] = -torch.inf
                if k > 0:
                    if alg_temp is None or alg_temp == 0:
                        _, t_idx = torch.topk(full, k)
                    else:
                        t_idx = torch.multinomial(torch.softmax(full / alg_temp, dim=-1).float(), k, generator=g)
                    x_ = torch.full_like(x[:, lo:w_hi], MASK)
                    x_[mask_index] = x0
                    rows = torch.arange(x.shape[0])[:, None].expand_as(t_idx)
                    x[:, lo:w_hi][rows, t_idx] = x_[rows, t_idx]
                i += 1
            if (x[:, lo:hi] == MASK).sum() == 0:
                break
    return x, nfe


CASES = [
    dict(steps=8, block_length=4, temperature=0.0),
    dict(steps=12, block_length=4, temperature=0.0),
    dict(steps=8, block_length=8, temperature=0.7, top_k=5),
    dict(steps=8, block_length=4, temperature=0.0, alg_temp=0.5),
    dict(steps=8, block_length=4, temperature=0.0, threshold=0.5),
    dict(steps=8, block_length=8, temperature=0.6, top_p=0.9, threshold=0.2),
]


@pytest.mark.parametrize("dual", [False, True])
@pytest.mark.parametrize("kw", CASES)
def test_dream_block_trajectories_are_token_exact(model, dual, kw):
    kw = dict(dict(top_p=None, top_k=None, alg_temp=None), **kw)
    # steps is the reference's argument; under threshold generate refuses a passed steps (it is ignored)
    given = {k: v for k, v in kw.items() if k != "steps" or "threshold" not in kw}
    out = model.generate(PROMPT, gen_length=8, kv_cache="dual" if dual else "prefix", seed=3, fwd_hooks=NO_MASK,
                         **given)
    with torch.no_grad():
        ref, nfe = reference(model, PROMPT.clone(), 8, kw["steps"], kw["block_length"], dual, kw.get("threshold"),
                             kw["temperature"], kw["top_p"], kw["top_k"], kw["alg_temp"], 1e-3,
                             torch.Generator().manual_seed(3))
    assert torch.equal(out.tokens, ref)
    assert out.trajectory.n_steps == nfe
    assert int(out.trajectory.n_committed.sum()) == 8 and out.settings["alg"] in ("entropy", "confidence_threshold")


@pytest.mark.parametrize("kw, argument", [
    (dict(block_length=4), "block_length"),
    (dict(threshold=0.5), "kv_cache"),
    (dict(kv_cache="prefix", alg="maskgit_plus"), "alg"),
    (dict(kv_cache="prefix", block_length=3), "block_length"),
    (dict(kv_cache="prefix", block_length=4, steps=2), "steps"),
    (dict(kv_cache="dual", threshold=2.0), "threshold"),
    (dict(alg=None), "alg"),  # None is not "unset": Dream's algorithms are named
    (dict(kv_cache="dual", alg=None), "alg"),
])
def test_inconsistent_block_settings_are_refused(model, kw, argument):
    with pytest.raises(SamplerConfigError) as info:
        model.generate(PROMPT, gen_length=8, **kw)
    assert info.value.argument == argument


def test_dream_block_batches_and_padding(model):
    two = torch.tensor([[3, 4, 5, 6, 7], [8, 9, 10, 11, 12]])
    with pytest.raises(SamplerConfigError, match="one prompt at a time"):
        model.generate(two, gen_length=8, kv_cache="dual", block_length=4, threshold=0.5)
    with pytest.raises(SamplerConfigError, match="padded batch"):
        model.generate(two, attention_mask=torch.tensor([[0, 1, 1, 1, 1], [1] * 5]), gen_length=8,
                       kv_cache="dual", block_length=4)
    out = model.generate(two, gen_length=8, steps=8, kv_cache="dual", block_length=4, temperature=0,
                         fwd_hooks=NO_MASK)
    with torch.no_grad():
        ref, _ = reference(model, two.clone(), 8, 8, 4, True, None, 0.0, None, None, None, 1e-3, None)
    assert torch.equal(out.tokens, ref)


def test_the_threshold_rule_keeps_a_confidence_equal_to_the_threshold():
    """Fast-dLLM's Dream rule drops a ranked position only when its confidence is *below* the threshold: a
    saturated softmax (exactly 1.0) passes threshold=1.0."""
    from mdm_lens.diffusion.dream_block import _threshold_step

    logits = torch.full((1, 4, 20), -1e4)
    logits[0, :, 3] = 0.0  # every row certain: confidence exactly 1.0
    window = torch.full((1, 4), MASK)
    proposal, transfer, conf = _threshold_step(logits, window, MASK, 4, 1.0, 0.0, None, None, None)
    assert bool((conf == 1.0).all()) and transfer.all() and (proposal == 3).all()
    logits[0, 2, 4] = -2.0  # one row slightly unsure: it alone waits
    _, transfer, _ = _threshold_step(logits, window, MASK, 4, 1.0, 0.0, None, None, None)
    assert transfer.tolist() == [[True, True, False, True]]
