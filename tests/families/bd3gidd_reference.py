"""Plain-torch transcriptions of the BD3LM and GIDD references, written independently of mdm_lens.ddit:
- `BD3Reference`: the hub `DITBackbone` of kuleshov-group/bd3lms @ 1c3e8f43 `models/hf/modeling_bd3lm.py` (eval,
  fp32, sdpa backend) with its per-block KV cache (`reset_kv_cache`, `get_qkv`'s write / store / left shift), the
  2n×2n `block_diff_mask` and the sampling slices `mask[n:n+L, n:n+L]`;
- `reference_semi_ar`: `Diffusion._semi_ar_sampler` + `_ddpm_caching_update` + `_nucleus_sample` (diffusion.py),
  with its numpy global RNG and torch's global RNG (`rand_like` in float64, `randint` on the CPU);
- `reference_gidd_sample`: dvruette/gidd @ f67acc96 `GiddSampler` + `HybridDiffusion` + `utils.sample_categorical`."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from tests.families.ddit_reference import _layer_norm, _rotate_half, _timestep_embedding, reference_forward


def _mask(n: int, bs: int) -> torch.Tensor:
    q, kv = torch.arange(2 * n)[:, None], torch.arange(2 * n)[None, :]
    x0q, x0k = q >= n, kv >= n
    bq = torch.where(x0q, (q - n) // bs, q // bs)
    bk = torch.where(x0k, (kv - n) // bs, kv // bs)
    return ((bq == bk) & (x0q == x0k)) | ((bq > bk) & x0k & ~x0q) | ((bq >= bk) & x0k & x0q)


def _cos_sin(length: int, hd: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
    freqs = torch.einsum("i,j->ij", torch.arange(length).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos()[None, :, None, None, :].repeat(1, 1, 3, 1, 1)
    sin = emb.sin()[None, :, None, None, :].repeat(1, 1, 3, 1, 1)
    cos[:, :, 2], sin[:, :, 2] = 1.0, 0.0
    return cos, sin


class BD3Reference:
    def __init__(self, sd: dict, n_heads: int, n: int, block_size: int, time_conditioning: bool = False):
        self.sd, self.h, self.n, self.bs, self.tc = sd, n_heads, n, block_size, time_conditioning
        self.n_blocks = len({k.split(".")[2] for k in sd if k.startswith("backbone.blocks.")})
        self.mask = _mask(n, block_size)
        self.kv_cache: list | None = None
        self.cache_idx = 0

    def reset_kv_cache(self, batch: int) -> None:
        d = self.sd["backbone.vocab_embed.embedding"].shape[1]
        self.kv_cache = [torch.zeros(batch, self.n, 3 * d) for _ in range(self.n_blocks)]
        self.cache_idx = 0

    def _get_qkv(self, i: int, x: torch.Tensor, cos_sin, store_kv: bool, last: bool) -> torch.Tensor:
        new = F.linear(x, self.sd[f"backbone.blocks.{i}.attn_qkv.weight"])
        if self.kv_cache is not None:
            self.kv_cache[i][:, self.cache_idx:self.cache_idx + self.bs] = new
            qkv = self.kv_cache[i][:, :self.cache_idx + self.bs].clone()
        else:
            qkv = new
        if store_kv and last:  # each block advances its own index in the reference; one shared index here
            self.cache_idx += self.bs
            if self.cache_idx >= self.n:
                self.cache_idx = self.n - self.bs
                for c in self.kv_cache:
                    c[:, :-self.bs] = c[:, self.bs:].clone()
        B, S, _ = qkv.shape
        qkv = qkv.view(B, S, 3, self.h, -1)
        cos, sin = cos_sin
        return qkv * cos + _rotate_half(qkv) * sin

    def __call__(self, indices: torch.Tensor, sigma: torch.Tensor, sample_mode: bool = False,
                 store_kv: bool = False) -> torch.Tensor:
        sd, p = self.sd, "backbone."
        if not self.tc:
            sigma = torch.zeros_like(sigma)
        x = sd[p + "vocab_embed.embedding"][indices]
        f = _timestep_embedding(sigma)
        c = F.silu(F.linear(F.silu(F.linear(f, sd[p + "sigma_map.mlp.0.weight"], sd[p + "sigma_map.mlp.0.bias"])),
                            sd[p + "sigma_map.mlp.2.weight"], sd[p + "sigma_map.mlp.2.bias"]))
        n = self.n
        mask = self.mask
        hd = x.shape[-1] // self.h
        if not sample_mode:
            cos_sin = _cos_sin(n, hd)
        elif self.kv_cache is not None:
            mask, cos_sin = None, _cos_sin(self.cache_idx + self.bs, hd)
        else:
            cos_sin, mask = _cos_sin(x.shape[1], hd), mask[n:n + x.shape[1], n:n + x.shape[1]]
        for i in range(self.n_blocks):
            b = f"{p}blocks.{i}."
            mods = F.linear(c, sd[b + "adaLN_modulation.weight"], sd[b + "adaLN_modulation.bias"])[:, None]
            shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mods.chunk(6, dim=2)
            skip = x
            u = _layer_norm(x, sd[b + "norm1.weight"]) * (1 + scale_msa) + shift_msa
            if not sample_mode:
                qkv = torch.cat((self._get_qkv(i, u[:, :n], cos_sin, False, False),
                                 self._get_qkv(i, u[:, n:], cos_sin, False, False)), dim=1)
            else:
                qkv = self._get_qkv(i, u, cos_sin, store_kv, i == self.n_blocks - 1)
            qkv = qkv.transpose(1, 3)
            att = F.scaled_dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], attn_mask=mask,
                                                 scale=1 / math.sqrt(qkv.shape[-1]))
            att = att.transpose(1, 2).flatten(2)
            if self.kv_cache is not None:
                att = att[:, -self.bs:]
            x = skip + gate_msa * F.linear(att, sd[b + "attn_out.weight"])
            u = _layer_norm(x, sd[b + "norm2.weight"]) * (1 + scale_mlp) + shift_mlp
            x = x + gate_mlp * F.linear(F.gelu(F.linear(u, sd[b + "mlp.0.weight"], sd[b + "mlp.0.bias"]),
                                               approximate="tanh"), sd[b + "mlp.2.weight"], sd[b + "mlp.2.bias"])
        o = p + "output_layer."
        shift, scale = F.linear(c, sd[o + "adaLN_modulation.weight"], sd[o + "adaLN_modulation.bias"])[:, None].chunk(2, 2)
        logits = F.linear(_layer_norm(x, sd[o + "norm_final.weight"]) * (1 + scale) + shift, sd[o + "linear.weight"],
                          sd[o + "linear.bias"])
        return logits if sample_mode else logits[:, :n]


def _subs(logits: torch.Tensor, xt: torch.Tensor, mask_index: int) -> torch.Tensor:
    logits[:, :, mask_index] += -1000000.0
    logits = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    unmasked = xt != mask_index
    logits[unmasked] = -1000000.0
    logits[unmasked, xt[unmasked]] = 0
    return logits


def _gumbel_argmax(p: torch.Tensor) -> torch.Tensor:
    return (p / (1e-10 - (torch.rand_like(p) + 1e-10).log())).argmax(dim=-1)


def reference_semi_ar(ref: BD3Reference, n_samples: int, num_steps: int, num_strides: int, bos: int, mask_index: int,
                      first_hitting: bool = True, nucleus_p: float = 1.0, kv_cache: bool = False,
                      context_size: int | None = None) -> torch.Tensor:
    """`_semi_ar_sampler` (var_length false, no entropy stop below 256 tokens); the caller seeds numpy and torch."""
    bs = ref.bs
    context_size = context_size or ref.n
    sigma_max = -math.log1p(-(1 - 1e-3))

    def forward(x, sigma, store_kv=False):
        sigma = sigma.mean(-1)
        logits = ref(x, sigma, sample_mode=True, store_kv=store_kv)
        return _subs(logits, x, mask_index)

    def nucleus(p_x0):
        if nucleus_p == 1.0:
            return p_x0
        p_ = p_x0[:, -bs:].clone()
        sorted_probs, idx = p_.sort(dim=-1, descending=True)
        keep = sorted_probs.cumsum(dim=-1) <= nucleus_p
        keep[..., 0] = 1
        sorted_probs = sorted_probs * keep
        p_.scatter_(-1, idx, sorted_probs * keep)
        p_ /= p_.sum(-1, keepdim=True)
        p_x0[:, -bs:] = p_
        return p_x0

    def update(x, t, dt, p_x0):
        mc_t, mc_s = t, t - dt
        sigma_t = torch.min(-torch.log(1 - mc_t), torch.tensor(sigma_max))
        mask_prob = mc_s[:, None] / mc_t[:, None]
        if p_x0 is None:
            if kv_cache:
                p_x0 = forward(x[:, -bs:], sigma_t).to(torch.float64)
            else:
                p_x0 = forward(x, sigma_t).to(torch.float64)[:, -bs:]
            p_x0 = nucleus(p_x0.exp())
        if first_hitting:
            x_block = _gumbel_argmax(p_x0)
            num_masked = (x[:, -bs:] == mask_index).sum(-1)
            ind = torch.randint(0, num_masked, (x_block.shape[0],))
            ind = (x[:, -bs:] == mask_index).nonzero()[ind, 1]
            m = (torch.arange(bs) == ind[:, None]).to(x_block.dtype)
            x_block = x_block * m + x[:, -bs:] * (1 - m)
        else:
            q = p_x0 * (1 - mask_prob)
            q[:, :, mask_index] = mask_prob.squeeze(-1)
            x_block = _gumbel_argmax(q)
        copy = (x[:, -bs:] != mask_index).to(x.dtype)
        x_block = copy * x[:, -bs:] + (1 - copy) * x_block
        x_new = torch.cat((x[:, :-bs], x_block), dim=-1)
        if kv_cache and mask_index not in x_block:
            forward(x_block, sigma_t, store_kv=True)
        return (None, x_new) if not torch.allclose(x_new, x) else (p_x0, x_new)

    ones = torch.ones((n_samples, 1), dtype=torch.float32)
    if kv_cache:
        ref.reset_kv_cache(n_samples)
    for stride in range(num_strides):
        if stride == 0:
            x_accum = torch.full((n_samples, bs), mask_index, dtype=torch.long)
            x_accum[:, 0] = bos
        else:
            x_accum = torch.cat((x_accum, torch.full((n_samples, bs), mask_index, dtype=torch.long)), dim=1)
        end = (stride + 1) * bs
        fwd_idx = torch.arange(max(end - context_size, 0), end)
        dt, cache, t = 1 / num_steps, None, 1
        timesteps = torch.linspace(1, 0, num_steps)
        for i in range(num_steps):
            if mask_index not in x_accum:
                break
            if first_hitting:
                u = np.random.rand()
                num_masked = (x_accum[:, fwd_idx] == mask_index).sum(-1).item()
                t *= u ** (1 / num_masked)
            else:
                t = timesteps[i]
            cache, x_next = update(x_accum[:, fwd_idx], t * ones, dt, cache)
            x_accum[:, fwd_idx] = x_next
    return x_accum


def reference_gidd_sample(sd: dict, n_heads: int, z: torch.Tensor, steps: int, mask_id: int, p_uniform: float,
                          t_eps: float = 1e-4, min_p: float = 0.0, keep: torch.Tensor | None = None) -> torch.Tensor:
    """`GiddSampler._do_generate` from a start canvas `z` (all [MASK] in the reference); `keep` marks positions
    restored after every step (a prompt: our extension, absent from the reference). The caller seeds torch."""
    V = sd["backbone.vocab_embed.embedding"].shape[0]
    hd = sd["backbone.vocab_embed.embedding"].shape[1] // n_heads
    sd = dict(sd, **{"backbone.rotary_emb.inv_freq": 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))})
    p_u = max(np.exp(-20), p_uniform)
    log_B = torch.tensor(float(np.log(2) + np.log(p_u) - np.log(1 - p_u))).clip(-20)
    mask = torch.zeros(V)
    mask[mask_id] = 1
    unif = (1 - mask) / (V - 1)

    def alpha_betapi(t):
        t = t[:, None]
        c_t = t.pow(0.5) * (1 - t).pow(0.5) * log_B.exp()
        C_t = (1 + c_t).clip(1e-4)
        return (1 - t) / C_t, (t * mask + c_t * unif) / C_t

    def probs_at_t(prs, t):
        a, bp = alpha_betapi(t)
        out = prs.mul(a.unsqueeze(-1))
        out[..., :bp.shape[-1]].add_(bp.unsqueeze(1))
        return out

    ts = torch.linspace(0, 1, steps + 1).unsqueeze(-1)
    ts = (1 - 2 * t_eps) * ts + t_eps
    for i in range(steps - 1, -1, -1):
        t, s = ts[i], ts[max(0, i - 1)]
        logits = reference_forward(sd, n_heads, z, t.expand(z.shape[0]))
        logits[..., mask_id] = -1e6
        q_s, q_t = probs_at_t(logits.softmax(-1), s), probs_at_t(logits.softmax(-1), t)
        q_zt = q_t.gather(-1, z.unsqueeze(-1))
        a_t, bp_t = alpha_betapi(t)
        a_s, bp_s = alpha_betapi(s)
        a_ts, bp_ts = a_t / a_s, bp_t - a_t / a_s * bp_s
        vz = F.one_hot(z, num_classes=V)
        q_ts = a_ts * vz + bp_ts.unsqueeze(1).expand_as(vz).gather(-1, z.unsqueeze(-1))
        q_st = q_ts * q_s / q_zt
        if min_p > 0.0:
            small = (q_st < min_p).float()
            q_st = (1 - small) * q_st
            q_st = q_st / q_st.sum(-1, keepdim=True)
        u = torch.rand(q_st.shape[:-1], dtype=q_st.dtype).unsqueeze(-1)
        cum = q_st.cumsum(-1)
        cum[..., -1] = 1 + 1e-4
        z_new = torch.searchsorted(cum, u, right=True).squeeze(-1)
        z = z_new if keep is None else torch.where(keep, z, z_new)
    return z
