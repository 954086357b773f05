"""The attention-extraction method of the reference code (NEUIR/Attention-Floating,
`src/attention_extraction/Llada.py`; architectures.md §10), re-implemented on the transformers Llama
that holds the benchmark weights, with the LLaDA sampler it wraps (greedy, low-confidence remasking).

Attention is *recomputed* from the hidden states: `hidden_states[l]` → the layer's input norm →
q/k(/v) projections → RoPE on `arange(T)` → repeat KV → `softmax(qkᵀ/√d)` in fp32 → mean over heads
→ `.cpu().numpy()`. Two ways to get per-step statistics for every layer (the temporal figure needs
them at every step; the released script only extracts committed rows during sampling and full
matrices once at the end):

* `"per_layer"` — the reference's `extract_full_attention_matrix(x, l)` called at every step for
  every layer: each call runs its own full forward with `output_hidden_states=True`
  (1 sampling forward + L extraction forwards per step).
* `"shared"` — the reference's in-sampler path (`generate_with_attention`): the step's sampling
  forward returns the hidden states, then each layer is recomputed from them for the committed
  position (1 forward + L recomputations per step).
"""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F

Mode = Literal["per_layer", "shared"]


def recompute_attention(hf: Any, hidden: torch.Tensor, layer_idx: int) -> np.ndarray:
    """Head-averaged attention `[T, T]` of one layer from the residual stream entering it."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

    layer = hf.model.layers[layer_idx]
    attn = layer.self_attn
    b, t, _ = hidden.shape
    hd = attn.head_dim
    x = layer.input_layernorm(hidden)
    q = attn.q_proj(x).view(b, t, -1, hd).transpose(1, 2)
    k = attn.k_proj(x).view(b, t, -1, hd).transpose(1, 2)
    attn.v_proj(x)  # the reference projects v too (and discards it)
    position_ids = torch.arange(t, device=hidden.device)[None]
    cos, sin = hf.model.rotary_emb(hidden, position_ids)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k = repeat_kv(k, q.shape[1] // k.shape[1])
    w = torch.softmax(torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(hd), dim=-1, dtype=torch.float32).to(q.dtype)
    return w.mean(dim=1).squeeze(0).float().cpu().numpy()


def _transfer_counts(mask_index: torch.Tensor, steps: int) -> torch.Tensor:
    mask_num = mask_index.sum(dim=1, keepdim=True)
    base, rem = mask_num // steps, mask_num % steps
    out = torch.zeros(mask_num.size(0), steps, dtype=torch.int64) + base
    for i in range(mask_num.size(0)):
        out[i, : rem[i]] += 1
    return out


@torch.no_grad()
def reference_trajectory(hf: Any, prompt: torch.Tensor, *, steps: int, gen_length: int, block_length: int,
                         mask_id: int, layers: list[int], mode: Mode) -> tuple[torch.Tensor, list[dict]]:
    """Run LLaDA sampling and extract attention at every step; returns the tokens and, per step,
    `{"step", "sequence", "layer_{l}_attention_avg" ([T,T], per_layer) or "layer_{l}_rows" (shared)}`."""
    x = torch.full((1, prompt.shape[1] + gen_length), mask_id, dtype=torch.long)
    x[:, : prompt.shape[1]] = prompt
    n_blocks = gen_length // block_length
    per_block = steps // n_blocks
    records: list[dict] = []
    step = 0
    for nb in range(n_blocks):
        end = prompt.shape[1] + (nb + 1) * block_length
        counts = _transfer_counts(x[:, end - block_length:end] == mask_id, per_block)
        for i in range(per_block):
            mask_index = x == mask_id
            out = hf(x, output_hidden_states=mode == "shared")
            logits = out.logits
            x0 = torch.argmax(logits, dim=-1)
            p = F.softmax(logits, dim=-1)
            x0_p = torch.gather(p, -1, x0[..., None]).squeeze(-1)
            x0_p[:, end:] = -np.inf
            x0 = torch.where(mask_index, x0, x)
            confidence = torch.where(mask_index, x0_p, -np.inf)
            transfer = torch.zeros_like(x0, dtype=torch.bool)
            for j in range(confidence.shape[0]):
                _, sel = torch.topk(confidence[j], k=int(counts[j, i]))
                transfer[j, sel] = True
            rec: dict[str, Any] = {"step": step, "sequence": x[0].clone()}
            if mode == "shared":
                positions = torch.where(transfer[0])[0].tolist()
                for l in layers:
                    for pos in positions:  # the reference recomputes the layer once per committed position
                        rec.setdefault(f"layer_{l}_rows", []).append(
                            recompute_attention(hf, out.hidden_states[l], l)[pos])
            else:
                for l in layers:  # extract_full_attention_matrix: a fresh forward per layer
                    hs = hf(x, output_hidden_states=True).hidden_states
                    rec[f"layer_{l}_attention_avg"] = recompute_attention(hf, hs[l], l)
            records.append(rec)
            x[transfer] = x0[transfer]
            step += 1
    return x, records
