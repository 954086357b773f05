"""An independent plain-torch transcription of DreamOn's `MDMGenerator.batch_generate_with_expand_as_token`
(DreamLM/DreamOn@8a0a5491 eval/generator.py; families-2.md §8.1), written from the reference's steps: the whole
`max_tokens` buffer is forwarded with Dream's pair mask and `tok_idx` positions, exactly as there. The reference's
global-RNG draws (`Categorical.sample`, `torch.multinomial`) come from one seeded generator, in the same order."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def ref_sample_tokens(logits, temperature, top_p, top_k, margin, neg_entropy, g):
    if temperature > 0:
        logits = logits / temperature
    if top_p is not None and top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True)
        drop = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1) > top_p
        drop[..., 1:] = drop[..., :-1].clone()
        drop[..., 0] = 0
        logits = logits.masked_fill(torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, order, drop),
                                    torch.finfo(logits.dtype).min)
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1)))[0][..., -1, None]
        logits = logits.masked_fill(logits < kth, torch.finfo(logits.dtype).min)
    probs = torch.softmax(logits, dim=-1)
    if temperature > 0:
        x0 = torch.multinomial(probs, 1, generator=g).squeeze(-1)
        confidence = torch.gather(probs, -1, x0[:, None]).squeeze(-1)
    else:
        confidence, x0 = probs.max(dim=-1)
    if margin:
        top = torch.sort(probs, dim=-1, descending=True)[0]
        confidence = top[:, 0] - top[:, 1]
    if neg_entropy:
        confidence = torch.sum(probs * torch.log(probs + 1e-10), dim=-1)
    return confidence, x0


@torch.no_grad()
def reference_expand_generate(model, input_ids, *, mask_id, expand_id, eos_id, steps, min_gen_len, max_gen_len,
                              max_tokens=2048, alg="entropy", alg_temp=0.0, temperature=0.1, top_p=0.9, top_k=None,
                              delete_eos_token=True, pad_eos_to_right=True, seed=0, logit_hook=None):
    """Returns (x, num_generation_tokens) as the reference does. `logit_hook(step, logits)` may edit the shifted
    full-buffer logits before they are read (the tests' planted expand / delete steps)."""
    g = torch.Generator().manual_seed(seed)
    max_tokens = min(max_tokens, input_ids.shape[1] + max_gen_len - min_gen_len)
    x = F.pad(input_ids, (0, max_tokens - input_ids.shape[1]), value=mask_id)
    n_gen, budget = min_gen_len, max_gen_len
    for i in range(steps):
        window = input_ids.shape[1] - min_gen_len + n_gen
        am = F.pad(torch.ones([1, window], dtype=torch.int16), (0, max_tokens - window), value=0)
        mask_index = (x == mask_id) & (am == 1)
        if torch.all(~mask_index[:, :window]):
            break
        tok_idx = am.long().cumsum(-1) - 1
        tok_idx.masked_fill_(am == 0, 1)
        pair = am.bool()[:, None, None, :] & am.bool()[:, None, :, None]
        raw = model(x, attn_mask=pair, position_ids=tok_idx)
        logits = torch.cat([raw[:, :1], raw[:, :-1]], dim=1)
        if logit_hook is not None:
            logits = logit_hook(i, logits)
        logits = logits[mask_index]
        if window == max_tokens or budget == 0:
            logits[:, expand_id] -= 1e9
        confidence, x0 = ref_sample_tokens(logits, temperature, top_p, top_k, alg == "topk_margin",
                                           alg == "entropy", g)
        if alg_temp is None or alg_temp == 0:
            _, transfer = torch.topk(confidence, 1)
        else:
            transfer = torch.multinomial(F.softmax(confidence / alg_temp, dim=-1), num_samples=1, generator=g)
        x0_ = torch.zeros_like(x0) + mask_id
        x0_[transfer] = x0[transfer].clone()
        x[mask_index] = x0_
        if pad_eos_to_right:
            seq = x[0]
            eos_at = (seq == eos_id).nonzero(as_tuple=True)[0]
            if len(eos_at) > 0:
                seq.masked_fill_((torch.arange(seq.size(0)) >= eos_at[0].item()) & mask_index[0], eos_id)
                x = seq[None]
        for idx in sorted((x[0] == expand_id).nonzero(as_tuple=False).squeeze(1).tolist(), reverse=True):
            x = torch.cat((x[:, :idx], torch.tensor([[mask_id, mask_id]]), x[:, idx + 1:]), dim=1)
            n_gen += 1
            budget -= 1
            if x.shape[1] > max_tokens:
                x = x[:, :max_tokens]
        if delete_eos_token:
            gone = ((x[0] == eos_id) & (mask_index[0] == 1)).nonzero(as_tuple=False).squeeze(1)
            for idx in sorted(gone.tolist(), reverse=True):
                x = torch.cat((x[:, :idx], x[:, idx + 1:], torch.tensor([[mask_id]])), dim=1)
                n_gen -= 1
    return x, n_gen
