"""An independent transcription of Fast-dLLM v2's inference, written from reading the reference (not copied):
`v2/generation_functions.py` (`batch_sample`, `get_factor_unmask_idx`) of NikhilSDate/Fast-dLLM @ 734a60d4b3ff,
and the modeling file it runs (`Fast_dLLM_QwenModel.forward` / `eval_mask`, `Fast_dLLM_QwenAttention.forward`,
`sample_with_top_p`; the `Fast_dLLM_v2` modeling.py of the code index). Nothing here imports mdm_lens.

`RefModel` is the reference model's eval-mode forward in plain torch on the hub state dict, with its real
per-layer KV caches: `RefCache` plays the part of `DynamicCache` (`past_key_values`, filtered row-wise by
`batch_sample` through `key_cache` / `value_cache`) and of `block_past_key_values` (updated in place at
`replace_position`). `batch_sample` follows the reference's control flow statement by statement."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F


class RefCache:
    def __init__(self) -> None:
        self.key_cache: list[torch.Tensor] = []
        self.value_cache: list[torch.Tensor] = []

    def __len__(self) -> int:
        return len(self.key_cache)

    def get_seq_length(self) -> int:
        return self.key_cache[0].shape[2] if self.key_cache else 0

    def update(self, k, v, layer):
        if len(self.key_cache) <= layer:
            self.key_cache.append(k)
            self.value_cache.append(v)
        else:
            self.key_cache[layer] = torch.cat([self.key_cache[layer], k], dim=2)
            self.value_cache[layer] = torch.cat([self.value_cache[layer], v], dim=2)
        return self.key_cache[layer], self.value_cache[layer]


class RefModel:
    """Qwen2 in eval mode as the reference runs it (`config`: the checkpoint's config.json, `sd`: its tensors)."""

    def __init__(self, config: dict, sd: dict, device: str = "cpu"):
        self.c, self.sd, self.device = config, sd, torch.device(device)
        self.heads = config["num_attention_heads"]
        self.kv_heads = config["num_key_value_heads"]
        self.head_dim = config["hidden_size"] // self.heads

    def _rms(self, x, w):
        x32 = x.float()
        return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.c["rms_norm_eps"])).to(x.dtype)

    def _rope(self, x, positions):
        e = self.head_dim
        inv = 1.0 / (self.c["rope_theta"] ** (torch.arange(0, e, 2, dtype=torch.int64).float() / e))
        freqs = positions.float()[:, None] * inv[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        rotated = torch.cat([-x[..., e // 2:], x[..., :e // 2]], dim=-1)
        return x * emb.cos() + rotated * emb.sin()

    def forward(self, input_ids, use_cache=False, past_key_values=None, update_past_key_values=False,
                block_size=32, use_block_cache=False, block_past_key_values=None, replace_position=None):
        sd, b, n = self.sd, input_ids.shape[0], input_ids.shape[1]
        if use_cache and past_key_values is None:
            past_key_values = RefCache()
        if use_block_cache and block_past_key_values is None:
            block_past_key_values = RefCache()
        seen = past_key_values.get_seq_length() if past_key_values is not None else 0
        start = seen + (replace_position if use_block_cache and replace_position is not None else 0)
        positions = torch.arange(start, start + n)
        if use_block_cache and block_past_key_values.get_seq_length() != 0:
            mask = None
        else:  # eval_mask: query block >= key block, blocks of `block_size` from position 0
            q_idx, k_idx = torch.arange(n) + seen, torch.arange(n + seen)
            mask = (q_idx[:, None] // block_size) >= (k_idx[None, :] // block_size)
        h = sd["model.embed_tokens.weight"][input_ids]
        for layer in range(self.c["num_hidden_layers"]):
            p = f"model.layers.{layer}."
            x = self._rms(h, sd[p + "input_layernorm.weight"])
            q, k, v = (F.linear(x, sd[p + f"self_attn.{t}_proj.weight"], sd[p + f"self_attn.{t}_proj.bias"])
                       .view(b, n, -1, self.head_dim).transpose(1, 2) for t in "qkv")
            q, k = self._rope(q, positions), self._rope(k, positions)
            if block_past_key_values is not None:
                if len(block_past_key_values) <= layer:
                    k, v = block_past_key_values.update(k, v, layer)
                else:
                    bk, bv = block_past_key_values.key_cache[layer], block_past_key_values.value_cache[layer]
                    bk[:, :, replace_position:replace_position + k.shape[2]] = k
                    bv[:, :, replace_position:replace_position + v.shape[2]] = v
                    k, v = bk, bv
            if past_key_values is not None:
                if update_past_key_values:
                    k, v = past_key_values.update(k, v, layer)
                elif len(past_key_values) > layer:
                    k = torch.cat([past_key_values.key_cache[layer], k], dim=2)
                    v = torch.cat([past_key_values.value_cache[layer], v], dim=2)
            rep = self.heads // self.kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            scores = (q @ k.transpose(2, 3)) * self.head_dim ** -0.5
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            z = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, n, -1)
            h = h + F.linear(z, sd[p + "self_attn.o_proj.weight"])
            x = self._rms(h, sd[p + "post_attention_layernorm.weight"])
            h = h + F.linear(F.silu(F.linear(x, sd[p + "mlp.gate_proj.weight"])) * F.linear(x, sd[p + "mlp.up_proj.weight"]),
                             sd[p + "mlp.down_proj.weight"])
        logits = F.linear(self._rms(h, sd["model.norm.weight"]), sd["lm_head.weight"])
        return SimpleNamespace(logits=logits, past_key_values=past_key_values,
                               block_past_key_values=block_past_key_values)

    def sample_with_top_p(self, logits, top_p=0.95, temperature=1.0):
        if not temperature > 0:
            p = torch.softmax(logits, dim=-1)
            return p.argmax(dim=-1), p
        probs = F.softmax(logits / temperature, dim=-1)
        ranked, order = torch.sort(probs, descending=True)
        cut = torch.cumsum(ranked, dim=-1) > top_p
        cut[..., 1:] = cut[..., :-1].clone()
        cut[..., 0] = 0
        probs[torch.zeros_like(probs, dtype=torch.bool).scatter_(dim=-1, index=order, src=cut)] = 0
        probs = probs / probs.sum(dim=-1, keepdim=True)
        return torch.multinomial(probs[0], num_samples=1).unsqueeze(0).squeeze(-1), probs


def factor_unmask_idx(x1_p, masked, factor_value=1.0):
    out = torch.zeros_like(x1_p, dtype=torch.bool)
    for j in range(x1_p.shape[0]):
        count = masked[j].sum().item()
        if count == 0:
            continue
        ranked = x1_p[j][masked[j]].sort(descending=True)[0]
        bars = [1.0 - factor_value / (m + 1) for m in range(1, count + 1)]
        bars[0] = -1.0
        for i in range(count):
            if ranked[i].item() < bars[i]:
                break
        if i == 0 or i == count - 1:
            i += 1
        out[j, torch.topk(x1_p[j], k=i)[1]] = True
    return out & masked


@torch.no_grad()
def batch_sample(model: RefModel, input_ids, pad_token_id, block_size, max_new_tokens, small_block_size, min_len,
                 seq_len, mask_id, threshold=0.95, stop_token=151645, use_block_cache=False, top_p=0.95,
                 temperature=0.0, factor=False, factor_value=1.0):
    """`batch_sample`'s control flow; returns ({row: tokens}, nfe) as the reference does."""
    n_blocks = max_new_tokens // block_size + seq_len.max().item() // block_size
    batch, nfe = input_ids.shape[0], 0
    if min_len > block_size:
        out = model.forward(input_ids[:, :min_len // block_size * block_size], use_cache=True,
                            update_past_key_values=True, block_size=block_size)
        nfe += 1
        past = out.past_key_values
        if min_len % block_size == 0:
            rows = seq_len == min_len
            tok = out.logits[rows, -1:, :].argmax(dim=-1)
            if input_ids.shape[1] <= min_len:
                input_ids = torch.cat([input_ids, tok], dim=1)
            else:
                input_ids[rows, min_len] = tok.squeeze(dim=-1)
    else:
        past = None
    seq_block = seq_len // block_size
    finished = torch.zeros(batch, dtype=torch.bool)
    n_small = block_size // small_block_size
    original = torch.arange(batch)
    done: dict[int, torch.Tensor] = {}
    for b in range(min_len // block_size, n_blocks):
        if finished.all():
            break
        if (seq_block == b).all():
            x_init = torch.cat([input_ids, torch.full((input_ids.shape[0], block_size - input_ids.shape[1] % block_size),
                                                      mask_id, dtype=torch.long)], dim=1)
            input_ids = x_init
        else:
            x_init = input_ids[:, :(b + 1) * block_size]
        x_init[finished, -block_size:] = pad_token_id
        x_t = x_init.clone()
        block_past = None
        while True:
            if (x_t[:, -block_size:] == mask_id).sum() == 0:
                for r in range(x_t.shape[0]):
                    if finished[r] and seq_len[r] < (b + 1) * block_size:
                        at = (x_t[r, seq_len[r]:] == stop_token).nonzero()[0][0]
                        x_t[r, seq_len[r] + at + 1:] = pad_token_id
                if finished.all():
                    break
                out = model.forward(x_t[:, -block_size:], use_cache=True, past_key_values=past,
                                    update_past_key_values=True, block_size=block_size)
                nfe += 1
                past = out.past_key_values
                tok = out.logits[:, -1:, :].argmax(dim=-1)
                tok[finished] = pad_token_id
                x_t = torch.cat([x_t, tok], dim=1)
                break
            for j in range(n_small):
                s0 = j * small_block_size
                s1 = s0 + small_block_size
                start, end = -block_size + s0, (None if block_size == s1 else -block_size + s1)
                while True:
                    masked = x_t[:, -block_size:] == mask_id
                    if masked[:, start:end].sum() == 0:
                        break
                    if use_block_cache:
                        if block_past is None or (x_t[:, -block_size + s0] == mask_id).any():
                            out = model.forward(x_t[:, -block_size:], use_cache=True, past_key_values=past,
                                                update_past_key_values=False, use_block_cache=True)
                            block_past = out.block_past_key_values
                            logits = torch.cat([out.logits[:, :1], out.logits[:, :-1]], dim=1)[:, start:end]
                        else:
                            logits = model.forward(x_t[:, start:end], use_cache=True, past_key_values=past,
                                                   update_past_key_values=False, use_block_cache=True,
                                                   block_past_key_values=block_past, replace_position=s0).logits
                            logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
                    else:
                        logits = model.forward(x_t[:, -block_size:], use_cache=True, past_key_values=past,
                                               update_past_key_values=False).logits
                        logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)[:, start:end]
                    nfe += 1
                    x_1, p_1t = model.sample_with_top_p(logits, top_p=top_p, temperature=temperature)
                    conf = torch.gather(p_1t, -1, x_1.unsqueeze(-1)).squeeze(-1)
                    conf = torch.where(masked[:, start:end], conf, -torch.inf)
                    if factor:
                        unmask = factor_unmask_idx(conf, masked[:, s0:s1], factor_value)
                    else:
                        unmask = conf > threshold
                        unmask[torch.arange(x_1.shape[0]), conf.argmax(dim=-1)] = True
                        unmask = unmask & masked[:, start:end]
                    x_t[:, start:end][unmask] = x_1[unmask]
                    finished = finished | ((x_1 == stop_token) & unmask).any(dim=1)
        if input_ids.shape[1] == x_t.shape[1]:
            input_ids = x_t
        else:
            input_ids[:, :(b + 1) * block_size] = x_t[:, :-1]
            if (seq_block == b).all():
                input_ids = torch.cat([input_ids, x_t[:, -1:]], dim=1)
            elif input_ids.shape[1] <= (b + 1) * block_size:
                input_ids = x_t
            else:
                here = seq_block == b
                input_ids[here, (b + 1) * block_size] = x_t[here, (b + 1) * block_size]
        seq_block[seq_block == b] = b + 1
        if finished.any():
            for r in range(x_t.shape[0]):
                if finished[r]:
                    done[original[r].item()] = x_t[r].clone()
            keep = ~finished
            original, input_ids, seq_block, seq_len, x_t = (t[keep] for t in (original, input_ids, seq_block,
                                                                               seq_len, x_t))
            for layer in range(len(past)):
                past.key_cache[layer] = past.key_cache[layer][keep]
                past.value_cache[layer] = past.value_cache[layer][keep]
            finished = finished[keep]
    if len(done) < batch:
        for r in range(x_t.shape[0]):
            done[original[r].item()] = x_t[r].clone()
    assert len(done) == batch
    return done, nfe
