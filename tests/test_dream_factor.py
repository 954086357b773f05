"""`factor=` on Dream's Fast-dLLM block decoding. Neither reference has a factor path for Dream: NVlabs/Fast-dLLM
@ 24cc59e `dream/model/generation_utils_block.py` and ZHZisZZ/dllm @ ca176752
`dllm/pipelines/fastdllm/dream/sampler.py` only have `confidence_threshold` (checked: no `factor` in either file).
So the rule is the reference's threshold loop (tests/test_dream_block.py transcribes it) with the threshold
comparison replaced by the factor rule as Fast-dLLM's LLaDA `get_transfer_index_dynamic` writes it (transcribed
here, independently of `mdm_lens.diffusion.fastdllm.factor_transfer`)."""

from __future__ import annotations

import pytest
import torch

from mdm_lens import SamplerConfigError
from mdm_lens.diffusion.dream import sample_tokens
from test_dream_block import MASK, NO_MASK, PROMPT, _kv_names, _raw, _shift, model  # noqa: F401  (fixture)


def _factor_rule(conf_row, masked_row, factor):
    """`get_transfer_index_dynamic`'s selection for one row, as there: thresholds by rank, rank 1 at -1, break at
    the first failing rank, +1 when that is the first or the last rank."""
    n = int(masked_row.sum())
    th = [1 - factor / (m + 1) for m in range(1, n + 1)]
    th[0] = -1
    ranked = torch.sort(conf_row[masked_row], descending=True)[0]
    for top in range(len(th)):
        if ranked[top] < th[top]:
            break
    if top == 0 or top == len(th) - 1:
        top += 1
    _, sel = torch.topk(conf_row, k=top)
    return sel


def reference(model, prompt, gen_length, block_length, dual, factor, temperature, top_p, top_k, g):
    x = torch.cat([prompt, torch.full((1, gen_length), MASK)], dim=1)
    total, p0, nfe = x.shape[1], prompt.shape[1], 0
    for b in range(gen_length // block_length):
        lo, hi = p0 + b * block_length, p0 + (b + 1) * block_length
        _, cache = model.run_with_cache(x, names_filter=lambda n: n.endswith(("hook_rot_k", "hook_v")))
        stale = {n: cache[n].clone() for n in _kv_names(model)}
        logits = _shift(_raw(model, x))
        nfe += 1
        _, x0 = sample_tokens(logits.reshape(-1, 20), temperature, top_p, top_k, generator=g)
        x[:, lo] = x0.view(x.shape)[:, lo]
        keep = torch.zeros(total, dtype=torch.bool)
        w_hi = hi if dual else total
        keep[lo:w_hi] = True
        while True:
            mask_index = x[:, lo:w_hi] == MASK
            logits = _shift(_raw(model, x, stale, keep)[:, lo:w_hi])
            nfe += 1
            c, x0 = sample_tokens(logits[mask_index], temperature, top_p, top_k, generator=g)
            x_ = torch.full_like(x[:, lo:w_hi], MASK)
            full = torch.full(x_.shape, -torch.inf)
            x_[mask_index] = x0
            full[mask_index] = c
            full[:, block_length:] = -torch.inf
            in_block = mask_index.clone()
            in_block[:, block_length:] = False
            t_idx = torch.zeros_like(x_, dtype=torch.bool)
            t_idx[0, _factor_rule(full[0], in_block[0], factor)] = True
            x[:, lo:w_hi][t_idx] = x_[t_idx]
            if (x[:, lo:hi] == MASK).sum() == 0:
                break
    return x, nfe


CASES = [
    dict(block_length=4, temperature=0.0, factor=1.0),
    dict(block_length=8, temperature=0.0, factor=0.3),
    dict(block_length=4, temperature=0.7, top_k=5, factor=2.5),
    dict(block_length=8, temperature=0.6, top_p=0.9, factor=1.0),
]


@pytest.mark.parametrize("dual", [False, True])
@pytest.mark.parametrize("kw", CASES)
def test_dream_factor_trajectories_are_token_exact(model, dual, kw):
    kw = dict(dict(top_p=None, top_k=None), **kw)
    out = model.generate(PROMPT, gen_length=8, kv_cache="dual" if dual else "prefix", seed=3,
                         fwd_hooks=NO_MASK, **kw)
    with torch.no_grad():
        ref, nfe = reference(model, PROMPT.clone(), 8, kw["block_length"], dual, kw["factor"], kw["temperature"],
                             kw["top_p"], kw["top_k"], torch.Generator().manual_seed(3))
    assert torch.equal(out.tokens, ref)
    assert out.trajectory.n_steps == nfe
    assert out.settings["factor"] == kw["factor"] and out.settings["alg"] == "confidence_threshold"
    assert out.settings["threshold"] is None and int(out.trajectory.n_committed.sum()) == 8


def test_the_factor_changes_how_many_commit_per_forward(model):
    """A tiny factor is almost 'threshold 1': one token per window forward, except the last two masked positions,
    which commit together (only the last rank fails: the reference's edge case). A huge factor passes every rank:
    the whole block commits at the first window forward."""
    runs = {f: model.generate(PROMPT, gen_length=8, kv_cache="dual", block_length=8, factor=f, temperature=0,
                              fwd_hooks=NO_MASK) for f in (1e-9, 100.0)}
    assert runs[1e-9].trajectory.n_committed[:, 0].tolist() == [1, 1, 1, 1, 1, 1, 2]
    assert runs[100.0].trajectory.n_committed[:, 0].tolist() == [1, 7]


def test_the_edge_ranks_in_the_dream_step():
    """Only the last rank failing still commits every masked position (the reference's quirk); the first rank
    always commits; positions past the block never commit."""
    from mdm_lens.diffusion.dream_block import _threshold_step

    window = torch.full((1, 6), MASK)
    logits = torch.full((1, 6, 20), -1e4)
    for p, v in enumerate([0.0, 0.0, 0.0, -30.0, 0.0, 0.0]):  # row 3 unsure; rows 4-5 are past the block
        logits[0, p, 3] = 0.0
        logits[0, p, 4] = v
    # softmax confidences: 0.5, 0.5, 0.5, ~1.0, 0.5, 0.5 → ranked (block of 4) ~1, .5, .5, .5 vs [-1, .667, .75, .8]
    _, transfer, conf = _threshold_step(logits, window, MASK, 4, None, 0.0, None, None, None, factor=1.0)
    assert transfer.tolist() == [[False, False, False, True, False, False]]  # rank 2 fails: only rank 1
    _, transfer, _ = _threshold_step(logits, window, MASK, 4, None, 0.0, None, None, None, factor=1.5)
    # thresholds [-1, .5, .625, .7]: rank 2 passes (0.5 >= 0.5), rank 3 fails → ranks 1-2
    assert int(transfer.sum()) == 2 and bool(transfer[0, 3]) and not transfer[0, 4:].any()
    _, transfer, _ = _threshold_step(logits, window, MASK, 4, None, 0.0, None, None, None, factor=1.9)
    # thresholds [-1, .367, .525, .62]: rank 3 fails (0.5 < 0.525) → ranks 1-2; factor 2.2: only rank 4 fails
    assert int(transfer.sum()) == 2
    _, transfer, _ = _threshold_step(logits, window, MASK, 4, None, 0.0, None, None, None, factor=2.2)
    # thresholds [-1, .267, .45, .56]: rank 4 (0.5) fails, the last rank: all four commit
    assert transfer.tolist() == [[True, True, True, True, False, False]]


@pytest.mark.parametrize("kw, argument", [
    (dict(factor=1.0), "kv_cache"),
    (dict(kv_cache="dual", factor=0.0), "factor"),
    (dict(kv_cache="dual", factor=1.0, threshold=0.9), "factor"),
    (dict(kv_cache="dual", factor=1.0, alg="entropy"), "alg"),
])
def test_inconsistent_factor_settings_are_refused(model, kw, argument):
    with pytest.raises(SamplerConfigError) as info:
        model.generate(PROMPT, gen_length=8, **kw)
    assert info.value.argument == argument


def test_factor_decodes_one_prompt_at_a_time(model):
    with pytest.raises(SamplerConfigError, match="factor= on Dream decodes one prompt at a time"):
        model.generate(torch.tensor([[3, 4, 5, 6, 7], [8, 9, 10, 11, 12]]), gen_length=8, kv_cache="dual",
                       block_length=4, factor=1.0)
