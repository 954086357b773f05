"""Hand computations for behaviours of mdm_lens.sae a held-out mutation audit found untested: the export's
per-batch seed at temperature > 0, and diffusion_ce_score's CE recovered and mean-centred FVU -- with a tiny
plain-torch SAE (SAELens' surface: encode, decode, W_dec, hooks(), use_error_term), so no sae-lens is needed."""

from contextlib import contextmanager

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mdm_lens.sae import MaskedCanvas, diffusion_ce_score

HOOK = "blocks.1.hook_resid_post"


class HalfSAE(nn.Module):
    """relu(x) - relu(-x) = x scaled by 1/2 in the decoder: reconstruction = x / 2 exactly."""

    def __init__(self, d):
        super().__init__()
        eye = torch.eye(d)
        self.W_enc = nn.Parameter(torch.cat([eye, -eye], 1))
        self.W_dec = nn.Parameter(0.5 * torch.cat([eye, -eye], 0))
        self.use_error_term = False

    def encode(self, x):
        return torch.relu(x @ self.W_enc)

    def decode(self, f):
        return f @ self.W_dec

    def forward(self, x):
        recon = self.decode(self.encode(x))
        return recon + (x - recon).detach() if self.use_error_term else recon

    @contextmanager
    def hooks(self, fwd_hooks=()):
        assert not fwd_hooks  # this stand-in has no hook points of its own
        yield self


def _ids(model, n=4, width=10, seed=0):
    ids = torch.randint(5, model.cfg.d_vocab, (n, width), generator=torch.Generator().manual_seed(seed))
    ids[:, 0] = model.cfg.bos_token_id
    ids[1, 7:] = model.cfg.pad_token_id          # one right-padded row: pads are left out of the FVU
    return ids


@torch.no_grad()
def test_ce_recovered_and_centred_fvu_equal_a_hand_computation(mdm):
    sae = HalfSAE(mdm.cfg.d_model)
    ids = _ids(mdm)
    got = diffusion_ce_score(mdm, sae, HOOK, ids, mask_rates=(0.5,), seeds=(3,)).iloc[0]
    noisy, masked = MaskedCanvas(mdm, mask_rate=0.5, positions="all", seed=3).mask(ids)
    am = (ids != mdm.cfg.pad_token_id).long()
    seen = {}

    def keep(x, hook):
        seen["x"] = x.clone()

    def ce(fn):
        logits = mdm.run_with_hooks(noisy, attention_mask=am, return_type="aligned", fwd_hooks=[(HOOK, fn)])
        return F.cross_entropy(logits[masked].double(), ids[masked]).item()

    clean = ce(keep)
    half = ce(lambda x, hook: x / 2)
    zero = ce(lambda x, hook: torch.zeros_like(x))
    assert got.n_masked == int(masked.sum()) > 0
    assert (got.ce_clean, got.ce_sae, got.ce_zero) == pytest.approx((clean, half, zero), abs=1e-6)
    assert abs(zero - clean) > 0.05 and abs(half - clean) > 1e-3           # the planted SAE recovers part of it
    assert got.ce_recovered == pytest.approx((zero - half) / (zero - clean), abs=1e-5)
    x = seen["x"][am.bool()].double()
    centred = ((x - x.mean(0)) ** 2).sum()
    assert got.fvu == pytest.approx(float(((x / 2) ** 2).sum() / centred), rel=1e-9)
    assert float(((x / 2) ** 2).sum() / (x ** 2).sum()) != pytest.approx(got.fvu, rel=1e-3)  # the mean matters
    assert got.l0 == pytest.approx(float((x != 0).sum(-1).double().mean()))


def test_export_seeds_each_batch_with_the_first_items_seed_at_temperature(mdm, tmp_path):
    pytest.importorskip("datasets")
    from mdm_lens.sae import export_activations
    from mdm_lens.sweep.runner import item_seed

    g = torch.Generator().manual_seed(1)
    prompts = [[mdm.cfg.bos_token_id] + torch.randint(5, mdm.cfg.d_vocab, (5,), generator=g).tolist()
               for _ in range(4)]
    kw = dict(n_steps=4, gen_length=6, sampler_kwargs={"temperature": 1.0})
    ds = export_activations(mdm, prompts, HOOK, out=tmp_path / "x", steps=[-1], positions="generated",
                            batch_size=2, seed=5, progress=False, **kw).with_format("numpy")
    item, final = np.asarray(ds["item_id"]), np.asarray(ds["final_token_id"])
    for first in (0, 2):   # two batches of two equal-length items: one generate call each
        ids = torch.tensor(prompts[first:first + 2])
        want = mdm.generate(ids, steps=4, gen_length=6, temperature=1.0, seed=item_seed(5, str(first)))
        other = mdm.generate(ids, steps=4, gen_length=6, temperature=1.0, seed=5)
        assert not torch.equal(want.tokens, other.tokens)     # the seed matters at temperature 1
        for b in range(2):
            rows = final[item == str(first + b)]
            assert np.array_equal(rows, want.tokens[b, 6:].numpy())
