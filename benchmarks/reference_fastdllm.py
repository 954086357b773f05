"""Fast-dLLM's cached LLaDA decoding in the reference's own form, for `bench_kvcache`: a transcription of
NVlabs/Fast-dLLM @ 24cc59e `llada/generate.py` (`generate_with_prefix_cache`, `generate_with_dual_cache`,
`get_transfer_index`, `get_num_transfer_tokens`; greedy, `low_confidence`) driving a minimal plain-torch LLaDA
forward with the `past_key_values` / `replace_position` interface of `llada/model/modeling_llada.py`:

* the cache holds keys *before* RoPE; every forward rotates all keys it attends to from position 0, and the
  queries at the positions just before the key length (prefix mode) or just before the block's end (dual mode,
  `replace_indices.max() + 1`);
* prefix mode concatenates `[cached prefix; x[block_start:]]`; dual mode writes the block's new keys/values into
  the full-length cache in place (`past_key[:, :, replace_indices] = k`) and attends to all of it;
* attention is SDPA without a mask (no padding), as the reference runs it.

The weights are read from a `HookedMDM` state dict (LLaDA layout: fused qkv rows [q; k; v], fused gate/up rows
[gate; up]); nothing of mdm_lens' forward or samplers is used.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor


class PlainLLaDA:
    """LLaDA's forward (RMSNorm, SwiGLU, RoPE, bidirectional SDPA) with Fast-dLLM's KV-cache arguments."""

    def __init__(self, state: dict[str, Tensor], cfg) -> None:
        self.h, self.g, self.e = cfg.n_heads, cfg.n_kv_heads, cfg.d_head
        self.eps, self.theta, self.n_layers = cfg.norm_eps, cfg.rope_theta, cfg.n_layers
        self.W_E, self.ln_f, self.W_U = state["embed.W_E"], state["ln_final.w"], state["unembed.weight"]
        self.layers = []
        for i in range(cfg.n_layers):
            p = f"blocks.{i}."
            q, k, v = state[p + "attn.qkv_weight"].split([self.h * self.e, self.g * self.e, self.g * self.e])
            gate, up = state[p + "mlp.gate_up_weight"].chunk(2)
            self.layers.append(dict(ln1=state[p + "ln1.w"], q=q.contiguous(), k=k.contiguous(), v=v.contiguous(),
                                    o=state[p + "attn.o_weight"], ln2=state[p + "ln2.w"], gate=gate.contiguous(),
                                    up=up.contiguous(), down=state[p + "mlp.down_weight"]))

    def _norm(self, x: Tensor, w: Tensor) -> Tensor:
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def _rope(self, key_len: int) -> tuple[Tensor, Tensor]:
        inv = 1.0 / (self.theta ** (torch.arange(0, self.e, 2, dtype=torch.float32) / self.e))
        freqs = torch.arange(key_len, dtype=torch.float32)[:, None] * inv[None]
        emb = torch.cat((freqs, freqs), -1)
        return emb.sin()[None, None], emb.cos()[None, None]

    @staticmethod
    def _rotate(t: Tensor, sin: Tensor, cos: Tensor) -> Tensor:
        x1, x2 = t.chunk(2, dim=-1)
        return t * cos + torch.cat((-x2, x1), dim=-1) * sin

    def _attention(self, lay: dict, x: Tensor, past: tuple[Tensor, Tensor] | None,
                   replace_position: Tensor | None) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        b, t, _ = x.shape
        q = F.linear(x, lay["q"]).view(b, t, self.h, self.e).transpose(1, 2)
        k = F.linear(x, lay["k"]).view(b, t, self.g, self.e).transpose(1, 2)
        v = F.linear(x, lay["v"]).view(b, t, self.g, self.e).transpose(1, 2)
        end = None
        if past is not None:
            past_key, past_value = past
            if replace_position is None:
                k, v = torch.cat((past_key, k), dim=-2), torch.cat((past_value, v), dim=-2)
            else:
                idx = replace_position.nonzero(as_tuple=True)[1]
                past_key[:, :, idx] = k
                past_value[:, :, idx] = v
                k, v = past_key, past_value
                end = int(idx.max()) + 1
        present = (k, v)  # before RoPE, as the reference caches them
        key_len = k.shape[-2]
        end = key_len if end is None else end
        sin, cos = self._rope(key_len)
        q = self._rotate(q, sin[:, :, end - t:end], cos[:, :, end - t:end])
        k = self._rotate(k, sin, cos)
        if self.g != self.h:
            k, v = k.repeat_interleave(self.h // self.g, 1), v.repeat_interleave(self.h // self.g, 1)
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=False)
        return F.linear(att.transpose(1, 2).reshape(b, t, -1), lay["o"]), present

    @torch.no_grad()
    def __call__(self, ids: Tensor, past_key_values: list | None = None, use_cache: bool = False,
                 replace_position: Tensor | None = None) -> tuple[Tensor, list | None]:
        x = F.embedding(ids, self.W_E)
        presents = []
        for i, lay in enumerate(self.layers):
            att, present = self._attention(lay, self._norm(x, lay["ln1"]),
                                           None if past_key_values is None else past_key_values[i], replace_position)
            x = x + att
            m = self._norm(x, lay["ln2"])
            x = x + F.linear(F.silu(F.linear(m, lay["gate"])) * F.linear(m, lay["up"]), lay["down"])
            presents.append(present)
        return F.linear(self._norm(x, self.ln_f), self.W_U), (presents if use_cache else None)


def get_num_transfer_tokens(mask_index: Tensor, steps: int) -> Tensor:
    mask_num = mask_index.sum(dim=1, keepdim=True)
    base, remainder = mask_num // steps, mask_num % steps
    out = torch.zeros(mask_num.size(0), steps, dtype=torch.int64) + base
    for i in range(mask_num.size(0)):
        out[i, : remainder[i]] += 1
    return out


def get_transfer_index(logits: Tensor, mask_index: Tensor, x: Tensor, num_transfer_tokens: Tensor | None,
                       threshold: float | None) -> tuple[Tensor, Tensor]:
    """Greedy (temperature 0: no Gumbel noise), `low_confidence` in float64, the threshold rule."""
    x0 = torch.argmax(logits, dim=-1)
    p = F.softmax(logits.to(torch.float64), dim=-1)
    x0_p = torch.squeeze(torch.gather(p, dim=-1, index=torch.unsqueeze(x0, -1)), -1)
    x0 = torch.where(mask_index, x0, x)
    confidence = torch.where(mask_index, x0_p, -np.inf)
    transfer = torch.zeros_like(x0, dtype=torch.bool)
    if threshold is not None:
        num_transfer_tokens = mask_index.sum(dim=1, keepdim=True)
    for j in range(confidence.shape[0]):
        _, select = torch.topk(confidence[j], k=int(num_transfer_tokens[j]))
        transfer[j, select] = True
        if threshold is not None:
            for k in range(1, int(num_transfer_tokens[j])):
                if confidence[j, select[k]] < threshold:
                    transfer[j, select[k]] = False
    return x0, transfer


def _setup(prompt: Tensor, steps: int, gen_length: int, block_length: int, mask_id: int) -> tuple[Tensor, int, int]:
    x = torch.full((1, prompt.shape[1] + gen_length), mask_id, dtype=torch.long)
    x[:, : prompt.shape[1]] = prompt.clone()
    assert gen_length % block_length == 0
    num_blocks = gen_length // block_length
    assert steps % num_blocks == 0
    return x, num_blocks, steps // num_blocks


def _first_step(model: PlainLLaDA, x: Tensor, block_end: int, mask_id: int, counts: Tensor,
                threshold: float | None) -> list:
    logits, past = model(x, use_cache=True)
    mask_index = x == mask_id
    mask_index[:, block_end:] = 0
    x0, transfer = get_transfer_index(logits, mask_index, x, counts[:, 0] if threshold is None else None, threshold)
    x[transfer] = x0[transfer]
    return past


@torch.no_grad()
def generate_with_prefix_cache(model: PlainLLaDA, prompt: Tensor, steps: int, gen_length: int, block_length: int,
                               mask_id: int, threshold: float | None = None) -> tuple[Tensor, int]:
    x, num_blocks, steps = _setup(prompt, steps, gen_length, block_length, mask_id)
    nfe = 0
    for nb in range(num_blocks):
        start = prompt.shape[1] + nb * block_length
        end = start + block_length
        counts = get_num_transfer_tokens(x[:, start:end] == mask_id, steps)
        past = _first_step(model, x, end, mask_id, counts, threshold)
        past = [tuple(t[:, :, :start] for t in layer) for layer in past]
        nfe += 1
        i = 1
        while True:
            nfe += 1
            mask_index = x[:, start:] == mask_id
            mask_index[:, block_length:] = 0
            logits, _ = model(x[:, start:], past_key_values=past, use_cache=True)
            torch.argmax(logits, dim=-1)  # the reference computes x0 here too, then again in get_transfer_index
            x0, transfer = get_transfer_index(logits, mask_index, x[:, start:],
                                              counts[:, i] if threshold is None else None, threshold)
            x[:, start:][transfer] = x0[transfer]
            if (x[:, start:end] == mask_id).sum() == 0:
                break
            i += 1
    return x, nfe


@torch.no_grad()
def generate_with_dual_cache(model: PlainLLaDA, prompt: Tensor, steps: int, gen_length: int, block_length: int,
                             mask_id: int, threshold: float | None = None) -> tuple[Tensor, int]:
    x, num_blocks, steps = _setup(prompt, steps, gen_length, block_length, mask_id)
    nfe = 0
    for nb in range(num_blocks):
        start = prompt.shape[1] + nb * block_length
        end = start + block_length
        counts = get_num_transfer_tokens(x[:, start:end] == mask_id, steps)
        past = _first_step(model, x, end, mask_id, counts, threshold)
        nfe += 1
        i = 1
        replace_position = torch.zeros_like(x, dtype=torch.bool)
        replace_position[:, start:end] = 1
        while True:
            nfe += 1
            mask_index = x[:, start:end] == mask_id
            logits, _ = model(x[:, start:end], past_key_values=past, use_cache=True, replace_position=replace_position)
            x0, transfer = get_transfer_index(logits, mask_index, x[:, start:end],
                                              counts[:, i] if threshold is None else None, threshold)
            x[:, start:end][transfer] = x0[transfer]
            if (x[:, start:end] == mask_id).sum() == 0:
                break
            i += 1
    return x, nfe
