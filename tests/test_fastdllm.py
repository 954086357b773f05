"""Fast-dLLM threshold / factor decoding and EB-sampler on LLaDA: transfer sets on hand-built confidences, and whole
trajectories token-exact against transcriptions of the reference loops (NVlabs/Fast-dLLM @ 24cc59e
`llada/generate.py` `generate` + `get_transfer_index`; the factor rule from the later `get_transfer_index_dynamic`
of the same file; yks23/Information-Gain-Sampler `src/generators/eb_sampler.py` `generate_with_eb_sampler`)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from mdm_lens import HookedMDM, MDMConfig, ReceivedAttention, SamplerConfigError, steps
from mdm_lens.hooks.runner import StepsNotReachedWarning
from mdm_lens.diffusion.fastdllm import eb_transfer, factor_transfer, threshold_transfer
from sampler_rigs import identity_unembed, no_mask_hooks

MASK = 19
NO_MASK = no_mask_hooks(MASK)
PROMPT = torch.tensor([[3, 4, 5, 6]])




@pytest.fixture(scope="module")
def model():
    cfg = MDMConfig(d_model=24, n_layers=2, n_heads=2, n_kv_heads=1, d_mlp=16, d_vocab=20, mask_token_id=MASK,
                    n_ctx=40, eos_token_id=1)
    # planted: identity_unembed reads logits off the normalized residual, so ln_final.w must be 1
    m = HookedMDM.from_config(cfg, seed=3, init_std=0.6, init="normal")
    return identity_unembed(m)


def _rows(*values):
    return torch.tensor(values, dtype=torch.float64)


# --- transfer sets on hand-built confidences ---------------------------------------------------------------

def test_threshold_keeps_the_top_one_and_every_confidence_not_below():
    conf = _rows([0.5, 0.9, 0.2, float("-inf")], [0.1, 0.05, 0.3, 0.3])
    masked = torch.tensor([[True, True, True, False], [True, True, True, True]])
    t = threshold_transfer(conf, masked, 0.5)
    assert t.tolist() == [[True, True, False, False],   # 0.5 == threshold passes
                          [False, False, True, False]]  # none passes: the top one (a tie goes to topk's pick)
    assert threshold_transfer(conf, masked, 0.0)[0].tolist() == [True, True, True, False]
    assert threshold_transfer(conf, torch.zeros_like(masked), 0.5).sum() == 0


def test_factor_rule_thresholds_and_edge_ranks():
    masked = torch.ones(1, 4, dtype=torch.bool)
    # factor 1: thresholds by rank -1, 1-1/3, 1-1/4, 1-1/5 = [-1, .667, .75, .8]; ranked .9 .76 .7 .1: rank 3 fails
    assert factor_transfer(_rows([0.1, 0.7, 0.9, 0.76]), masked, 1.0).tolist() == [[False, False, True, True]]
    five = torch.ones(1, 5, dtype=torch.bool)  # thresholds [-1, .667, .75, .8, .833]: rank 4 (0.1) fails
    assert factor_transfer(_rows([0.1, 0.78, 0.9, 0.8, 0.05]), five, 1.0).tolist() == [[False, True, True, True,
                                                                                        False]]
    # rank 2 = 0.5 < .667 fails: only the top one
    assert factor_transfer(_rows([0.1, 0.5, 0.9, 0.2]), masked, 1.0).tolist() == [[False, False, True, False]]
    # a larger factor lowers every threshold: factor 2 gives [-1, .333, .5, .6]
    assert factor_transfer(_rows([0.1, 0.5, 0.9, 0.2]), masked, 2.0).tolist() == [[False, True, True, False]]
    # a confidence exactly at its threshold passes (the reference breaks on `<`): 0.75 at rank 3 for factor 1
    assert factor_transfer(_rows([0.1, 0.75, 0.9, 0.8, 0.05]), five, 1.0).tolist() == [[False, True, True, True,
                                                                                        False]]
    # the reference's last-rank quirk: only the last rank fails (0.1 < 0.8), yet every position commits
    assert factor_transfer(_rows([0.1, 0.95, 0.9, 0.85]), masked, 1.0).all()
    # one masked position: it commits whatever its confidence
    one = torch.tensor([[False, True, False, False]])
    assert factor_transfer(_rows([0.9, 1e-9, 0.9, 0.9]), one, 1.0).tolist() == [[False, True, False, False]]


def test_eb_commits_the_longest_prefix_within_the_bound():
    h = _rows([0.5, 0.125, 0.25, 5.0, 0.0])
    masked = torch.tensor([[True, True, True, True, False]])
    # ascending 0.125, 0.25, 0.5, 5.0: error = cumsum - cummax = 0, 0.125, 0.375, 0.875 (exact in binary)
    assert eb_transfer(h, masked, 0.375).tolist() == [[True, True, True, False, False]]  # == bound: included
    assert eb_transfer(h, masked, 0.37).tolist() == [[False, True, True, False, False]]
    assert eb_transfer(h, masked, 0.0).tolist() == [[False, True, False, False, False]]  # at least one
    assert eb_transfer(h, masked, 10.0).sum() == 4
    assert eb_transfer(h, torch.zeros_like(masked), 10.0).sum() == 0


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(0, 1), min_size=1, max_size=9), st.floats(0.05, 3))
def test_factor_rule_matches_a_direct_reading_of_the_reference(values, factor):
    conf = torch.tensor([values], dtype=torch.float64)
    masked = torch.ones_like(conf, dtype=torch.bool)
    ranked = sorted(values, reverse=True)
    n = len(values)
    thresholds = [-1.0] + [1 - factor / (r + 1) for r in range(2, n + 1)]
    top = n - 1
    for r in range(n):
        if ranked[r] < thresholds[r]:
            top = r
            break
    expected = top + 1 if top in (0, n - 1) else top
    assert int(factor_transfer(conf, masked, factor).sum()) == expected


# --- transcriptions of the reference loops ----------------------------------------------------------------

def _gumbel(logits, temperature):
    if temperature == 0:
        return logits
    logits = logits.to(torch.float64)
    return logits.exp() / (-torch.log(torch.rand_like(logits, dtype=torch.float64))) ** temperature


def reference_fastdllm(net, prompt, gen_length, block_length, temperature, remasking, threshold, factor):
    """NVlabs `generate` (no cache): per block, forward until the block holds no mask."""
    x = torch.cat([prompt, torch.full((prompt.shape[0], gen_length), MASK)], dim=1)
    p0 = prompt.shape[1]
    nfe = 0
    for b in range(gen_length // block_length):
        lo, hi = p0 + b * block_length, p0 + (b + 1) * block_length
        while True:
            nfe += 1
            mask_index = x == MASK
            logits = net(x)
            mask_index[:, hi:] = False
            x0 = torch.argmax(_gumbel(logits, temperature), dim=-1)
            if remasking == "low_confidence":
                x0_p = torch.gather(F.softmax(logits.to(torch.float64), dim=-1), -1, x0[..., None])[..., 0]
            else:
                x0_p = torch.rand(x0.shape)
            x0 = torch.where(mask_index, x0, x)
            conf = torch.where(mask_index, x0_p, -math.inf)
            transfer = torch.zeros_like(mask_index)
            for j in range(x.shape[0]):
                n = int(mask_index[j].sum())
                if factor is None:
                    _, sel = torch.topk(conf[j], k=n)
                    transfer[j, sel] = True
                    for k in range(1, n):
                        if conf[j, sel[k]] < threshold:
                            transfer[j, sel[k]] = False
                else:
                    th = [1 - factor / (m + 1) for m in range(1, n + 1)]
                    th[0] = -1
                    sc = torch.sort(conf[j][mask_index[j]], descending=True)[0]
                    for top in range(len(th)):
                        if sc[top] < th[top]:
                            break
                    if top == 0 or top == len(th) - 1:
                        top += 1
                    _, sel = torch.topk(conf[j], k=top)
                    transfer[j, sel] = True
            x[transfer] = x0[transfer]
            if (x[:, lo:hi] == MASK).sum() == 0:
                break
    return x, nfe


def reference_eb(net, prompt, gen_length, gamma, temperature, cfg_scale):
    x = torch.cat([prompt, torch.full((1, gen_length), MASK)], dim=1)
    prompt_index = x != MASK
    nfe = 0
    while (x == MASK).any():
        nfe += 1
        mask_index = x == MASK
        logits = net(x)
        if cfg_scale > 0:
            un = x.clone()
            un[prompt_index] = MASK
            un_logits = net(un)
            logits = un_logits + (cfg_scale + 1) * (logits - un_logits)
        pred = torch.argmax(_gumbel(logits, temperature), dim=-1)
        err = torch.distributions.Categorical(logits=logits[mask_index]).entropy()
        idx = mask_index.nonzero(as_tuple=True)[1]
        order = torch.argsort(err)
        ranked = err[order]
        k = (torch.cumsum(ranked, 0) - torch.cummax(ranked, 0).values <= gamma).sum()
        k = torch.clamp(k, min=1, max=len(idx))
        x[0, idx[order][:k]] = pred[0, idx[order][:k]]
    return x, nfe


def _net(model):
    return lambda x: model.run_with_hooks(x, return_type="aligned", fwd_hooks=NO_MASK)


@pytest.mark.parametrize("kw", [
    dict(threshold=0.3, temperature=0.0, remasking="low_confidence", block_length=8),
    dict(threshold=0.6, temperature=0.0, remasking="low_confidence", block_length=4),
    dict(threshold=0.2, temperature=0.7, remasking="low_confidence", block_length=4),
    dict(threshold=0.5, temperature=0.0, remasking="random", block_length=8),
    dict(factor=1.0, temperature=0.0, remasking="low_confidence", block_length=8),
    dict(factor=2.5, temperature=0.5, remasking="low_confidence", block_length=4),
])
@pytest.mark.parametrize("seed", [0, 5])
def test_fastdllm_trajectories_are_token_exact(model, kw, seed):
    out = model.generate(PROMPT, gen_length=8, seed=seed, fwd_hooks=NO_MASK, **kw)
    torch.manual_seed(seed)
    with torch.no_grad():
        ref, nfe = reference_fastdllm(_net(model), PROMPT.clone(), 8, kw["block_length"], kw["temperature"],
                                      kw["remasking"], kw.get("threshold"), kw.get("factor"))
    assert torch.equal(out.tokens, ref)
    assert out.trajectory.n_steps == nfe
    # every masked slot committed exactly once, in its own block's steps
    cs = out.trajectory.commit_step[0, 4:]
    assert (cs >= 0).all() and int(out.trajectory.n_committed.sum()) == 8
    blocks = out.trajectory.block_of_step[cs]
    assert blocks.tolist() == [p // kw["block_length"] for p in range(8)]


@pytest.mark.parametrize("gamma, temperature, cfg_scale", [(0.1, 0.0, 0.0), (2.0, 0.0, 0.0), (6.0, 0.8, 0.0),
                                                           (1.5, 0.0, 1.0)])
def test_eb_trajectories_are_token_exact(model, gamma, temperature, cfg_scale):
    out = model.generate(PROMPT, gen_length=8, sampler_rule="eb", gamma=gamma, temperature=temperature,
                         cfg_scale=cfg_scale, seed=2, fwd_hooks=NO_MASK)
    torch.manual_seed(2)
    with torch.no_grad():
        ref, nfe = reference_eb(_net(model), PROMPT.clone(), 8, gamma, temperature, cfg_scale)
    assert torch.equal(out.tokens, ref) and out.trajectory.n_steps == nfe
    assert int(out.trajectory.n_committed.sum()) == 8


def test_a_larger_bound_commits_more_per_step(model):
    few = model.generate(PROMPT, gen_length=8, sampler_rule="eb", gamma=0.0)
    many = model.generate(PROMPT, gen_length=8, sampler_rule="eb", gamma=100.0)
    assert few.trajectory.n_steps == 8 and many.trajectory.n_steps == 1


def test_observation_on_a_run_of_unknown_length(model):
    out = model.generate(PROMPT, gen_length=8, threshold=0.9, record=[ReceivedAttention()],
                         cache="blocks.0.hook_resid_post" @ steps(0, 1), fwd_hooks=NO_MASK)
    n = out.trajectory.n_steps
    assert n > 2 and out.records["received_attention"].shape[0] == n  # one row per forward that ran
    assert out.cache.steps == [0, 1]
    # threshold 0 commits the whole block at once: one forward, so step 1 (the first one past the end) and step 5
    # of the 8-step budget are never reached
    with pytest.warns(StepsNotReachedWarning, match=r"cache: steps \[1, 5\] were asked for, but the run stopped "
                                                    r"after 1 forward"):
        out = model.generate(PROMPT, gen_length=8, threshold=0.0, cache="blocks.0.hook_resid_post" @ steps(0, 1, 5),
                             fwd_hooks=NO_MASK)
    assert out.cache.steps == [0] and out.trajectory.n_steps == 1
    with pytest.raises(SamplerConfigError, match="counted from the end"):
        model.generate(PROMPT, gen_length=8, threshold=0.3, record=[ReceivedAttention(when=steps("last"))])
    with pytest.raises(SamplerConfigError, match="counted from the end"):
        model.generate(PROMPT, gen_length=8, factor=1.0, hook_steps=[-1], fwd_hooks=[("hook_embed", print)])


@pytest.mark.parametrize("kw, argument", [
    (dict(threshold=0.5, factor=1.0), "factor"),
    (dict(threshold=1.5), "threshold"),
    (dict(threshold=-0.1), "threshold"),
    (dict(factor=0), "factor"),
    (dict(threshold=0.5, cfg_scale=1.0), "cfg_scale"),
    (dict(threshold=0.5, logits_eos_inf=True), "logits_eos_inf"),
    (dict(gamma=0.5), "gamma"),
    (dict(sampler_rule="eb", block_length=4), "block_length"),
    (dict(sampler_rule="eb", threshold=0.5), "threshold"),
    (dict(sampler_rule="eb", remasking="random"), "remasking"),
    (dict(sampler_rule="eb", gamma=-1), "gamma"),
    (dict(sampler_rule="greedy"), "sampler_rule"),
])
def test_inconsistent_parallel_settings_are_refused_before_compute(model, kw, argument):
    calls = []
    with pytest.raises(SamplerConfigError) as info:
        model.generate(PROMPT, gen_length=8, fwd_hooks=[("hook_embed", lambda x, hook: calls.append(1))], **kw)
    assert info.value.argument == argument and calls == []


def test_eb_refuses_a_batch_and_dream_refuses_the_llada_options():
    cfg = MDMConfig(d_model=16, n_layers=1, n_heads=2, d_mlp=16, d_vocab=20, mask_token_id=MASK, n_ctx=40)
    m = HookedMDM.from_config(cfg, seed=0)
    with pytest.raises(SamplerConfigError, match="one prompt at a time"):
        m.generate(torch.tensor([[3, 4], [5, 6]]), gen_length=4, sampler_rule="eb")
    dream = HookedMDM.from_config(MDMConfig(d_model=16, n_layers=1, n_heads=2, d_mlp=16, d_vocab=20,
                                            mask_token_id=MASK, n_ctx=40, logit_shift=True), seed=0)
    with pytest.raises(SamplerConfigError, match="threshold"):
        dream.generate(PROMPT, gen_length=4, threshold=0.9)
    dream.generate(PROMPT, gen_length=4, threshold=None)  # the do-nothing value passes


def test_confidences_are_float64_softmax_probabilities_whatever_the_logits_dtype():
    """Fast-dLLM ranks by `softmax(logits.to(float64))`: in bf16 the probabilities would be quantised (~1/256 near
    0.9) and threshold decisions at the boundary would change."""
    from mdm_lens.diffusion.fastdllm import propose

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(1, 6, 20, generator=g) * 3).to(torch.bfloat16)
    x = torch.full((1, 6), MASK)
    eligible = torch.ones(1, 6, dtype=torch.bool)
    x0, transfer, conf = propose(logits, x, eligible, 0.0, "low_confidence", 0.5, None, None, None)
    expected = torch.softmax(logits.to(torch.float64), -1).max(-1).values
    assert conf.dtype == torch.float64 and torch.equal(conf, expected)
    assert torch.equal(x0, logits.argmax(-1))
