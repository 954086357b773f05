"""The LLaDA sampler against an independent transcription of the reference `generate.py` (architectures.md §2.5),
token for token with the same random draws: left-padded batches, classifier-free guidance (whose unconditional
copy masks the pads too, as there), temperatures, blocks, random remasking, and the EOS/EoT options."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mdm_lens import HookedMDM, MDMConfig, masks

MASK, EOS, EOT, PAD = 49, 1, 2, 0


def model_for(seed=1):
    cfg = MDMConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_mlp=48, d_vocab=50, mask_token_id=MASK,
                    n_ctx=64, eos_token_id=EOS, pad_token_id=PAD, extra={"eot_token_id": EOT})
    # planted: the EOS/EoT boost below was tuned on unit-norm weights so that the options change this run
    model = HookedMDM.from_config(cfg, seed=seed, init_std=0.3, init="normal")
    with torch.no_grad():  # make EOS and EoT frequent picks, so that their options matter
        model.unembed.weight[EOS] = 2 * (model.unembed.weight[EOS] + 0.6 * model.unembed.weight[5])
        model.unembed.weight[EOT] = 2 * (model.unembed.weight[EOT] + 0.6 * model.unembed.weight[5])
        model.unembed.weight[5] *= 1.5
    return model


def gumbel(logits, temperature, g):
    if temperature == 0:
        return logits
    logits = logits.to(torch.float64)
    noise = torch.rand(logits.shape, generator=g, dtype=torch.float64)
    return logits.exp() / (-torch.log(noise)) ** temperature


@torch.no_grad()
def reference_generate(model, prompt, attention_mask, steps, gen_length, block_length, temperature, cfg_scale,
                       remasking, logits_eos_inf, confidence_eos_eot_inf, seed):
    g = torch.Generator().manual_seed(seed)
    b, lp = prompt.shape
    x = torch.full((b, lp + gen_length), MASK, dtype=torch.long)
    x[:, :lp] = prompt
    am = torch.cat([attention_mask, torch.ones(b, gen_length, dtype=torch.long)], dim=1)
    prompt_index = x != MASK
    num_blocks = gen_length // block_length
    spb = steps // num_blocks
    for nb in range(num_blocks):
        lo, hi = lp + nb * block_length, lp + (nb + 1) * block_length
        n = (x[:, lo:hi] == MASK).sum(dim=1, keepdim=True)
        num = torch.zeros(b, spb, dtype=torch.long) + n // spb
        for j in range(b):
            num[j, :int(n[j] % spb)] += 1
        for i in range(spb):
            mask_index = x == MASK
            if cfg_scale > 0:
                un_x = x.clone()
                un_x[prompt_index] = MASK  # pads included, as the reference
                both = torch.cat([x, un_x], dim=0)
                # pads are hidden keys: given as an explicit key mask, since they now hold the mask id
                out = model(both, attn_mask=masks.key_padding(torch.cat([am, am], dim=0)))
                logits, un_logits = torch.chunk(out, 2, dim=0)
                logits = un_logits + (cfg_scale + 1) * (logits - un_logits)
            else:
                logits = model(x, attention_mask=am)
            if logits_eos_inf:
                logits[:, :, EOS] = -torch.inf
            logits_with_noise = gumbel(logits, temperature, g)
            x0 = torch.argmax(logits_with_noise, dim=-1)
            if confidence_eos_eot_inf:
                logits_with_noise[:, :, EOS] = logits[:, :, EOT] = -torch.inf
            if remasking == "low_confidence":
                p = F.softmax(logits, dim=-1)
                x0_p = torch.squeeze(torch.gather(p, dim=-1, index=torch.unsqueeze(x0, -1)), -1)
            else:
                x0_p = torch.rand((x0.shape[0], x0.shape[1]), generator=g)
            x0_p[:, hi:] = -float("inf")
            x0 = torch.where(mask_index, x0, x)
            confidence = torch.where(mask_index, x0_p, -float("inf"))
            transfer = torch.zeros_like(x0, dtype=torch.bool)
            for j in range(b):
                _, select = torch.topk(confidence[j], k=int(num[j, i]))
                transfer[j, select] = True
            x[transfer] = x0[transfer]
    return x


PROMPT = torch.tensor([[7, 8, 9, 10, 11, 12], [PAD, PAD, 13, 14, 15, 16]])
AM = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])

CASES = [  # temperature, cfg_scale, remasking, block_length, logits_eos_inf, confidence_eos_eot_inf
    (0.0, 0.0, "low_confidence", 8, False, False),
    (0.0, 1.5, "low_confidence", 8, False, False),
    (0.0, 0.0, "low_confidence", 4, False, True),
    (0.0, 1.0, "low_confidence", 4, False, True),
    (0.8, 0.0, "low_confidence", 8, False, True),
    (0.8, 2.0, "low_confidence", 4, False, True),
    (0.8, 0.0, "random", 4, True, False),
    (0.0, 0.5, "random", 8, True, True),
]


@pytest.mark.parametrize("temperature, cfg_scale, remasking, block_length, eos_inf, eot_inf", CASES)
def test_llada_matches_the_reference_token_for_token(temperature, cfg_scale, remasking, block_length, eos_inf,
                                                     eot_inf):
    model = model_for()
    kw = dict(steps=8, gen_length=8, block_length=block_length, temperature=temperature, cfg_scale=cfg_scale,
              remasking=remasking, logits_eos_inf=eos_inf, confidence_eos_eot_inf=eot_inf)
    out = model.generate(PROMPT, attention_mask=AM, seed=3, **kw)
    ref = reference_generate(model, PROMPT, AM, seed=3, **kw)
    assert torch.equal(out.tokens, ref)


def test_the_eos_eot_option_changes_the_run_on_this_model():
    """The reference comparison above would be vacuous if the option changed nothing here."""
    model = model_for()
    kw = dict(steps=8, gen_length=8, block_length=4)
    for t in (0.0, 0.8):
        on = reference_generate(model, PROMPT, AM, 8, 8, 4, t, 0.0, "low_confidence", False, True, seed=3)
        off = reference_generate(model, PROMPT, AM, 8, 8, 4, t, 0.0, "low_confidence", False, False, seed=3)
        assert not torch.equal(on, off)
        assert torch.equal(model.generate(PROMPT, attention_mask=AM, temperature=t, seed=3,
                                          confidence_eos_eot_inf=True, **kw).tokens, on)


# --- Dream: an independent transcription of `diffusion_generate` (architectures.md §4.4) --------------------

def dream_model(seed=2):
    cfg = MDMConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_mlp=48, d_vocab=50, mask_token_id=MASK,
                    n_ctx=64, eos_token_id=EOS, pad_token_id=PAD, logit_shift=True, position_policy="cumsum",
                    padding_mask="pair", qkv_bias=True)
    return HookedMDM.from_config(cfg, seed=seed, init_std=0.3)


def ref_sample_tokens(logits, temperature, top_p, top_k, margin, neg_entropy, g):
    if temperature > 0:
        logits = logits / temperature
    if top_p is not None and top_p < 1:
        sorted_logits, sorted_indices = torch.sort(logits, descending=True)
        cumulative = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1)
        remove = cumulative > top_p
        remove[..., 1:] = remove[..., :-1].clone()
        remove[..., 0] = 0
        mask = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, sorted_indices, remove)
        logits = logits.masked_fill(mask, torch.finfo(logits.dtype).min)
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1)))[0][..., -1, None]
        logits = logits.masked_fill(logits < kth, torch.finfo(logits.dtype).min)
    probs = torch.softmax(logits, dim=-1)
    if temperature > 0:  # the reference's Categorical draw, here from the seeded generator
        x0 = torch.multinomial(probs, 1, generator=g).squeeze(-1)
        confidence = torch.gather(probs, -1, x0.unsqueeze(-1)).squeeze(-1)
    else:
        confidence, x0 = probs.max(dim=-1)
    if margin:
        sorted_probs, _ = torch.sort(probs, dim=-1, descending=True)
        confidence = sorted_probs[:, 0] - sorted_probs[:, 1]
    if neg_entropy:
        confidence = torch.sum(probs * torch.log(probs + 1e-10), dim=-1)
    return confidence, x0


@torch.no_grad()
def reference_diffusion_generate(model, input_ids, attention_mask, max_new_tokens, steps, eps, alg, alg_temp,
                                 temperature, top_p, top_k, seed):
    g = torch.Generator().manual_seed(seed)
    b = input_ids.shape[0]
    x = F.pad(input_ids, (0, max_new_tokens), value=MASK)
    if bool((attention_mask == 0).any()):
        am = F.pad(attention_mask, (0, max_new_tokens), value=1)
        tok_idx = (am.long().cumsum(-1) - 1).masked_fill(am == 0, 1)
        pair = am.bool()[:, None, :, None] & am.bool()[:, None, None, :]
    else:
        tok_idx, pair = None, None
    ts = torch.linspace(1, eps, steps + 1)
    for i in range(steps):
        mask_index = x == MASK
        raw = model(x, attn_mask=pair, position_ids=tok_idx)
        logits = torch.cat([raw[:, :1], raw[:, :-1]], dim=1)
        mask_logits = logits[mask_index]
        t, s = ts[i], ts[i + 1]
        if alg == "origin":
            p_transfer = 1 - s / t if i < steps - 1 else 1
            x0 = torch.zeros_like(x[mask_index], dtype=torch.long) + MASK
            transfer = torch.rand(*x0.shape, generator=g) < p_transfer
            _, x0[transfer] = ref_sample_tokens(mask_logits[transfer], temperature, top_p, top_k, False, False, g)
            x[mask_index] = x0.clone()
        else:
            confidence, x0 = ref_sample_tokens(mask_logits, temperature, top_p, top_k, alg == "topk_margin",
                                               alg == "entropy", g)
            n_mask = mask_index.sum() / mask_index.shape[0]
            n = int(n_mask * (1 - s / t)) if i < steps - 1 else int(n_mask)
            full = torch.full_like(x, -torch.inf, dtype=logits.dtype)
            full[mask_index] = confidence
            if n > 0:
                if alg_temp is None or alg_temp == 0:
                    _, transfer_index = torch.topk(full, n)
                else:
                    transfer_index = torch.multinomial(torch.softmax(full / alg_temp, dim=-1), n, generator=g)
                x_ = torch.zeros_like(x, dtype=torch.long) + MASK
                x_[mask_index] = x0.clone()
                rows = torch.arange(b).unsqueeze(1).expand_as(transfer_index)
                x[rows, transfer_index] = x_[rows, transfer_index]
    return x


DREAM_CASES = [  # alg, alg_temp, temperature, top_p, top_k, steps, padded
    ("origin", None, 0.0, None, None, 8, False),
    ("origin", None, 0.7, 0.9, None, 6, True),
    ("maskgit_plus", None, 0.0, None, None, 8, True),
    ("maskgit_plus", None, 0.5, 0.95, 10, 4, False),
    ("topk_margin", None, 0.0, None, 5, 8, True),
    ("entropy", None, 0.2, 0.95, None, 8, True),
    ("entropy", 0.5, 0.0, None, None, 6, False),
    ("topk_margin", 1.0, 1.0, None, 50, 8, True),
]


@pytest.mark.parametrize("alg, alg_temp, temperature, top_p, top_k, steps, padded", DREAM_CASES)
def test_dream_matches_the_reference_token_for_token(alg, alg_temp, temperature, top_p, top_k, steps, padded):
    model = dream_model()
    am = AM if padded else torch.ones_like(AM)
    out = model.generate(PROMPT, attention_mask=am, steps=steps, gen_length=8, alg=alg, alg_temp=alg_temp,
                         temperature=temperature, top_p=top_p, top_k=top_k, seed=5)
    ref = reference_diffusion_generate(model, PROMPT, am, 8, steps, 1e-3, alg, alg_temp, temperature, top_p, top_k,
                                       seed=5)
    assert torch.equal(out.tokens, ref)
