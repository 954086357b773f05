"""Shared by the lens tests: small runs of the shipped twin and of a random Dream-style model (logit shift)."""

import torch

from mdm_lens import HookedMDM, MDMConfig

MASK, EOS, PAD = 3, 2, 0
GEN = 8


def dream_model(seed=2):
    cfg = MDMConfig(d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_mlp=48, d_vocab=50, mask_token_id=MASK,
                    n_ctx=64, eos_token_id=EOS, pad_token_id=PAD, logit_shift=True, position_policy="cumsum",
                    padding_mask="pair", qkv_bias=True)
    return HookedMDM.from_config(cfg, seed=seed, init_std=0.3)


def twin_prompts(model):
    """Two zoo prompts of different lengths, left-padded, with their attention mask."""
    from mdm_lens.zoo import data as D

    items = D.make_dataset(2, seed=7, n_distractors=1)
    rows = [model.to_tokens(it.prompt)[0].tolist() for it in items]
    width = max(map(len, rows))
    ids = torch.full((2, width), PAD, dtype=torch.long)
    am = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], am[i, width - len(r):] = torch.tensor(r), 1
    return ids, am


def run(model, ids, am=None, **kw):
    return model.generate(ids, attention_mask=am, gen_length=GEN, steps=GEN, cache="blocks.*.hook_resid_post",
                          seed=0, **kw)
