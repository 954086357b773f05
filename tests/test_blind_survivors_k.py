"""Blind mutation list K (2026-12-05, written without reading tests/): the survivors, each pinned by a planted case
with the exact expected value."""

from contextlib import contextmanager

import pytest
import torch
from torch import nn

from mdm_lens.sae import MaskedCanvas, diffusion_ce_score

HOOK = "blocks.1.hook_resid_post"


class ThresholdSAE(nn.Module):
    """relu(x @ W - t): how many latents fire depends on the activation, so a pad row's L0 differs from a token's."""

    def __init__(self, d, t):
        super().__init__()
        self.W_enc = nn.Parameter(torch.cat([torch.eye(d), -torch.eye(d)], 1))
        self.W_dec = nn.Parameter(torch.cat([torch.eye(d), -torch.eye(d)], 0))
        self.t, self.use_error_term = t, False

    def encode(self, x):
        return torch.relu(x @ self.W_enc - self.t)

    def decode(self, f):
        return f @ self.W_dec

    def forward(self, x):
        return self.decode(self.encode(x))

    @contextmanager
    def hooks(self, fwd_hooks=()):
        yield self


@torch.no_grad()
def test_ce_score_l0_is_the_mean_over_non_pad_positions(mdm):
    ids = torch.randint(5, mdm.cfg.d_vocab, (3, 10), generator=torch.Generator().manual_seed(1))
    ids[:, 0] = mdm.cfg.bos_token_id
    ids[1, 4:] = mdm.cfg.pad_token_id                # a right-padded row: six pad positions
    seen = {}
    _, masked = MaskedCanvas(mdm, mask_rate=0.5, positions="all", seed=0).mask(ids)
    noisy = ids.masked_fill(masked, mdm.cfg.mask_token_id)
    real = ids != mdm.cfg.pad_token_id
    mdm.run_with_hooks(noisy, attention_mask=real.long(), fwd_hooks=[(HOOK, lambda x, hook: seen.update(x=x.clone()))])
    x = seen["x"]
    t = float(x.abs().median())
    sae = ThresholdSAE(mdm.cfg.d_model, t)
    l0 = (sae.encode(x) > 0).sum(-1).double()
    want, with_pads = float(l0[real].mean()), float(l0.mean())
    assert abs(want - with_pads) > 0.5                # the planted pads fire a different number of latents
    got = diffusion_ce_score(mdm, sae, HOOK, ids, mask_rates=(0.5,), seeds=(0,)).iloc[0]
    assert got.l0 == pytest.approx(want, abs=1e-4)


def test_memory_plan_counts_each_cached_phase(mdm):
    # with classifier-free guidance a cache bound to ("cond", "uncond") keeps two forwards per step: twice the bytes
    from mdm_lens.hooks import steps

    p = torch.randint(5, 300, (1, 6), generator=torch.Generator().manual_seed(0))
    kw = dict(gen_length=8, steps=4, cfg_scale=1.0)
    none = mdm.memory_plan(p, **kw).rows["cpu"].caches
    cond = mdm.memory_plan(p, cache="blocks.0.hook_resid_post" @ steps(), **kw).rows["cpu"].caches
    both = mdm.memory_plan(p, cache="blocks.0.hook_resid_post" @ steps(phases=("cond", "uncond")),
                           **kw).rows["cpu"].caches
    one = cond - none
    assert one == 4 * 1 * 14 * mdm.cfg.d_model * 4  # 4 steps x batch 1 x 14 positions x d_model x fp32
    assert both - none == 2 * one
