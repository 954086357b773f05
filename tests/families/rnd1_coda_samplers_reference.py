"""Transcriptions of RND1's `diffusion_sample` (RadicalNumerics/RND1 @ 87d5f465 `rnd/sampling.py`, prefix mode as
`RND1LM.generate(inputs)` calls it) and CoDA's `_sample` (SalesforceAIResearch/CoDA @ fa1d5050
`generation_utils.py`), batch 1, over a `logits_fn(tokens) -> raw logits`. Independent of mdm_lens. RND1's
categorical draw is the reference's own (`Categorical(...).sample()` on the global RNG, seeded by the caller);
CoDA's draws come from the caller's generator `g`, in the reference's order."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _top_k(logits, k):
    values, index = torch.topk(logits, min(k, logits.size(-1)), dim=-1)
    return torch.full_like(logits, float("-inf")).scatter_(-1, index, values)


def _top_p(logits, p):
    ordered, index = torch.sort(logits, descending=True, dim=-1)
    remove = torch.cumsum(torch.softmax(ordered, dim=-1), dim=-1) > p
    remove[..., 0] = False
    remove[..., 1:] = remove[..., :-1].clone()
    return logits.masked_fill(remove.scatter(-1, index, remove), float("-inf"))


def rnd1_diffusion_sample(logits_fn, prefix, max_new_tokens, num_steps, temperature, top_k, top_p, greedy,
                          mask_id, eos_id, pad_id, bos_id=None, add_eos_at_end=False, eb_gamma=None):
    pre = prefix.shape[-1]
    seq_len = pre + max_new_tokens
    infill = seq_len - pre - 1  # one slot reserved for EOS (eos_token_id is never None in generate)
    x = torch.full((1, seq_len), pad_id, dtype=torch.long)
    if add_eos_at_end:
        x[0, -1] = eos_id
    x[0, :pre] = prefix.flatten()
    x[0, pre:pre + infill] = mask_id
    maskable = torch.zeros_like(x, dtype=torch.bool)
    maskable[0, pre:pre + infill] = True
    if bos_id is not None:
        maskable[:, 0] = False
    maskable &= x.ne(eos_id)
    maskable &= x.ne(pad_id)
    xt = x.clone()
    forwards = []

    def scores(tokens):
        forwards.append(tokens.clone())
        logits = logits_fn(tokens) / max(temperature, 1e-8)
        if top_k is not None and top_k > 0:
            logits = _top_k(logits, top_k)
        if top_p is not None and 0 < top_p < 1.0:
            logits = _top_p(logits, top_p)
        logp = torch.log_softmax(logits, dim=-1)
        nxt = logp.argmax(-1) if greedy else torch.distributions.Categorical(logits=logp).sample()
        conf = torch.gather(logp, -1, nxt.unsqueeze(-1)).squeeze(-1)
        ent = -(logp.exp() * logp).sum(-1)
        pred_i, conf_i, ent_i = tokens.clone(), torch.full_like(conf, torch.finfo(conf.dtype).min), torch.zeros_like(ent)
        pred_i[:, 1:], conf_i[:, 1:], ent_i[:, 1:] = nxt[:, :-1], conf[:, :-1], ent[:, :-1]
        return pred_i, conf_i, ent_i

    pred, conf, ent = scores(xt)
    total = maskable.sum(1, keepdim=True)
    fin = torch.finfo(conf.dtype)
    for step in range(num_steps - 1, 0, -1):
        if eb_gamma is not None:
            err = (-conf.clone()).masked_fill(~maskable, fin.max)
            _, idx = torch.sort(err, dim=-1)
            ranked = torch.gather(ent, 1, idx)
            valid = (torch.cumsum(ranked, dim=-1) - torch.cummax(ranked, dim=-1)[0]) <= eb_gamma
            to_unmask = torch.zeros_like(maskable)
            k = int(valid[0].sum().item())
            if k > 0:
                cand = torch.zeros_like(maskable[0])
                cand[idx[0][:k]] = True
                to_unmask[0] = cand & maskable[0]
        else:
            cutoff = (total * (step / num_steps)).long().clamp(min=0)
            keep = torch.zeros_like(maskable)
            k = int(cutoff.max().item())
            if k > 0:
                _, idx = torch.topk(ent.masked_fill(~maskable, -fin.max), k, dim=-1, largest=True)
                keep[0, idx[0, :k]] = True
            to_unmask = maskable & ~keep
        if to_unmask.any():
            xt[to_unmask] = pred[to_unmask]
            maskable[to_unmask] = False
        if maskable.any():
            pred, conf, ent = scores(xt)
    if maskable.any():
        xt[maskable] = pred[maskable]
    return xt, forwards


def _filters(logits, temperature, top_p, top_k):
    if temperature > 0:
        logits = logits / temperature
    if top_p is not None and top_p < 1:
        ordered, index = torch.sort(logits, descending=True)
        remove = torch.cumsum(F.softmax(ordered, dim=-1), dim=-1) > top_p
        remove[..., 1:] = remove[..., :-1].clone()
        remove[..., 0] = 0
        mask = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, index, remove)
        logits = logits.masked_fill(mask, torch.finfo(logits.dtype).min)
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1)))[0][..., -1, None]
        logits = logits.masked_fill(logits < kth, torch.finfo(logits.dtype).min)
    return logits


def _sample_tokens(logits, temperature, top_p, top_k, neg_entropy, margin, g):
    probs = torch.softmax(_filters(logits, temperature, top_p, top_k), dim=-1)
    if temperature > 0:  # the reference's Categorical draw, from the seeded generator
        x0 = torch.multinomial(probs, 1, generator=g).squeeze(-1)
        conf = torch.gather(probs, -1, x0.unsqueeze(-1)).squeeze(-1)
    else:
        conf, x0 = probs.max(dim=-1)
    if margin:
        top = torch.sort(probs, dim=-1, descending=True)[0]
        conf = top[:, 0] - top[:, 1]
    if neg_entropy:
        conf = torch.sum(probs * torch.log(probs + 1e-10), dim=-1)
    return conf, x0


def coda_sample(logits_fn, input_ids, max_new_tokens, steps, eps, alg, alg_temp, temperature, top_p, top_k,
                mask_id, g):
    x = F.pad(input_ids, (0, max_new_tokens), value=mask_id)
    timesteps = torch.linspace(1, eps, steps + 1)
    for i in range(steps):
        mask_index = x == mask_id
        raw = logits_fn(x)  # CoDA's eval forward ignores any mask
        logits = torch.cat([raw[:, :1], raw[:, :-1]], dim=1)
        mask_logits = logits[mask_index]
        t, s = timesteps[i], timesteps[i + 1]
        if alg == "origin":
            p_transfer = 1 - s / t if i < steps - 1 else 1
            x0 = torch.zeros_like(x[mask_index]) + mask_id
            chosen = torch.rand(*x0.shape, generator=g) < p_transfer
            _, x0[chosen] = _sample_tokens(mask_logits[chosen], temperature, top_p, top_k, False, False, g)
            x[mask_index] = x0.clone()
            continue
        conf, x0 = _sample_tokens(mask_logits, temperature, top_p, top_k, alg == "entropy", alg == "topk_margin", g)
        n_mask = mask_index.sum() / mask_index.shape[0]
        n = int(n_mask * (1 - s / t)) if i < steps - 1 else int(n_mask)
        full = torch.full_like(x, -torch.inf, dtype=logits.dtype)
        full[mask_index] = conf
        if n > 0:
            if alg_temp is None or alg_temp == 0:
                _, index = torch.topk(full, n)
            else:
                index = torch.multinomial(F.softmax(full / alg_temp, dim=-1), num_samples=n, generator=g)
            cand = torch.zeros_like(x) + mask_id
            cand[mask_index] = x0.clone()
            rows = torch.arange(x.size(0)).unsqueeze(1).expand_as(index)
            x[rows, index] = cand[rows, index]
    return x
