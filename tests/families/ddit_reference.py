"""A plain-torch transcription of the DDiT reference forward (kuleshov-group/mdlm `models/dit.py` @ c112c526,
the hub `modeling_mdlm.py` / Duo `model.py` that share it; families-2.md §1.2) operating directly on a hub state dict.
Written independently of mdm_lens.ddit: packed qkv in the reference's 5-D layout, the [1, L, 3, 1, hd] cos/sin
tables with the v slot forced to identity, flash-attn's varlen call replaced by per-row full attention (what it
computes with uniform cu_seqlens), and the hub's SUBS / log-softmax post-processing."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _timestep_embedding(t: torch.Tensor, dim: int = 256, max_period: int = 10000) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(start=0, end=half, dtype=torch.float32) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def _layer_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x.float(), [x.shape[-1]]) * w[None, None, :]


def _rotary(seq_len: int, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.arange(seq_len).type_as(inv_freq)
    freqs = torch.einsum("i,j->ij", t, inv_freq.clone())
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos()[None, :, None, None, :].repeat(1, 1, 3, 1, 1)
    sin = emb.sin()[None, :, None, None, :].repeat(1, 1, 3, 1, 1)
    cos[:, :, 2, :, :].fill_(1.0)
    sin[:, :, 2, :, :].fill_(0.0)
    return cos, sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def reference_forward(sd: dict, n_heads: int, x: torch.Tensor, sigma: torch.Tensor,
                      time_conditioning: bool = True) -> torch.Tensor:
    """Logits [B, L, V] of the DDiT backbone (hub `DITBackbone.forward` in eval mode, fp32)."""
    p = "backbone."
    if not time_conditioning:
        sigma = torch.zeros_like(sigma)
    h = sd[p + "vocab_embed.embedding"][x]
    f = _timestep_embedding(sigma)
    emb = F.linear(F.silu(F.linear(f, sd[p + "sigma_map.mlp.0.weight"], sd[p + "sigma_map.mlp.0.bias"])),
                   sd[p + "sigma_map.mlp.2.weight"], sd[p + "sigma_map.mlp.2.bias"])
    c = F.silu(emb)
    B, L = x.shape
    cos, sin = _rotary(L, sd[p + "rotary_emb.inv_freq"])
    n_blocks = len({k.split(".")[2] for k in sd if k.startswith(p + "blocks.")})
    for i in range(n_blocks):
        b = f"{p}blocks.{i}."
        mods = F.linear(c, sd[b + "adaLN_modulation.weight"], sd[b + "adaLN_modulation.bias"])[:, None].chunk(6, dim=2)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mods
        skip = h
        u = _layer_norm(h, sd[b + "norm1.weight"]) * (1 + scale_msa) + shift_msa
        qkv = F.linear(u, sd[b + "attn_qkv.weight"]).view(B, L, 3, n_heads, -1)  # 'b s (three h d)'
        qkv = qkv * cos.to(qkv.dtype) + _rotate_half(qkv) * sin.to(qkv.dtype)
        q, k, v = (qkv[:, :, j].transpose(1, 2) for j in range(3))
        att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1) @ v
        att = att.transpose(1, 2).reshape(B, L, -1)
        h = skip + gate_msa * F.linear(att, sd[b + "attn_out.weight"])
        u = _layer_norm(h, sd[b + "norm2.weight"]) * (1 + scale_mlp) + shift_mlp
        y = F.linear(F.gelu(F.linear(u, sd[b + "mlp.0.weight"], sd[b + "mlp.0.bias"]), approximate="tanh"),
                     sd[b + "mlp.2.weight"], sd[b + "mlp.2.bias"])
        h = h + gate_mlp * y
    o = p + "output_layer."
    shift, scale = F.linear(c, sd[o + "adaLN_modulation.weight"], sd[o + "adaLN_modulation.bias"])[:, None].chunk(2, 2)
    z = _layer_norm(h, sd[o + "norm_final.weight"]) * (1 + scale) + shift
    return F.linear(z, sd[o + "linear.weight"], sd[o + "linear.bias"])


def reference_subs(logits: torch.Tensor, xt: torch.Tensor, mask_index: int) -> torch.Tensor:
    """`Diffusion._subs_parameterization` (neg_infinity = -1e6, in place on a copy)."""
    logits = logits.clone()
    logits[:, :, mask_index] += -1000000.0
    logits = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    unmasked_indices = xt != mask_index
    logits[unmasked_indices] = -1000000.0
    logits[unmasked_indices, xt[unmasked_indices]] = 0
    return logits


# --- the reference sampling loops (global torch RNG, as `L.seed_everything` + `rand_like` give them) -------------
def _sample_categorical(categorical_probs: torch.Tensor) -> torch.Tensor:
    gumbel_norm = 1e-10 - (torch.rand_like(categorical_probs) + 1e-10).log()
    return (categorical_probs / gumbel_norm).argmax(dim=-1)


def _total_noise(t: torch.Tensor, eps: float = 1e-3) -> torch.Tensor:
    return -torch.log1p(-(1 - eps) * t)


def reference_mdlm_sample(sd: dict, n_heads: int, x: torch.Tensor, mask_index: int, steps: int, predictor: str,
                          noise_removal: bool, time_conditioning: bool = False, eps: float = 1e-5) -> torch.Tensor:
    """`Diffusion._sample` from a given initial canvas `x` (the reference's is all masks)."""

    def forward(x, sigma):
        sigma = sigma.squeeze(-1) if sigma.ndim > 1 else sigma
        return reference_subs(reference_forward(sd, n_heads, x, sigma, time_conditioning), x, mask_index)

    timesteps = torch.linspace(1, eps, steps + 1)
    dt = (1 - eps) / steps
    p_x0_cache = None
    V = sd["backbone.vocab_embed.embedding"].shape[0]
    for i in range(steps):
        t = timesteps[i] * torch.ones(x.shape[0], 1)
        if predictor == "analytic":
            curr_sigma, next_sigma = _total_noise(t), _total_noise(t - dt)
            x = _sample_categorical(_analytic_probs(forward(x, curr_sigma), x, curr_sigma, curr_sigma - next_sigma,
                                                    mask_index, V))
            continue
        if predictor == "ddpm":
            sigma_t, sigma_s = _total_noise(t).squeeze(-1), _total_noise(t - dt).squeeze(-1)
            move_chance_t = (1 - torch.exp(-sigma_t))[:, None, None]
            move_chance_s = (1 - torch.exp(-sigma_s))[:, None, None]
            q_xs = forward(x, sigma_t).exp() * (move_chance_t - move_chance_s)
            q_xs[:, :, mask_index] = move_chance_s[:, :, 0]
            _x = _sample_categorical(q_xs)
            copy_flag = (x != mask_index).to(x.dtype)
            x = copy_flag * x + (1 - copy_flag) * _x
            continue
        sigma_t = _total_noise(t)
        tt = t.squeeze(-1)
        move_chance_t, move_chance_s = tt[:, None, None], (tt - dt)[:, None, None]
        p_x0 = p_x0_cache if p_x0_cache is not None else forward(x, sigma_t).exp()
        q_xs = p_x0 * (move_chance_t - move_chance_s)
        q_xs[:, :, mask_index] = move_chance_s[:, :, 0]
        _x = _sample_categorical(q_xs)
        copy_flag = (x != mask_index).to(x.dtype)
        x_next = copy_flag * x + (1 - copy_flag) * _x
        p_x0_cache = None if (not torch.allclose(x_next, x) or time_conditioning) else p_x0
        x = x_next
    if noise_removal and predictor == "analytic":  # `_denoiser_update`: dσ = σ, the mask column zeroed, a draw
        sigma = _total_noise(timesteps[-1] * torch.ones(x.shape[0], 1))
        probs = _analytic_probs(forward(x, sigma), x, sigma, sigma, mask_index, V)
        probs[..., mask_index] = 0
        x = _sample_categorical(probs)
    elif noise_removal:
        t = timesteps[-1] * torch.ones(x.shape[0], 1)
        x = forward(x, _total_noise(t)).argmax(dim=-1)
    return x


def _analytic_probs(model_output: torch.Tensor, x: torch.Tensor, sigma: torch.Tensor, dsigma: torch.Tensor,
                    mask_index: int, V: int) -> torch.Tensor:
    """`get_score` → `_staggered_score` → × `_transp_transition` (sigma, dsigma: [B, 1] as in the reference)."""
    log_k = -torch.log(torch.expm1(sigma)).squeeze(-1)
    masked = model_output + log_k[:, None, None]
    masked[:, :, mask_index] = 0
    unmasked = torch.scatter(-1000000.0 * torch.ones_like(model_output), -1, x[..., None],
                             torch.zeros_like(model_output[..., :1]))
    unmasked[:, :, mask_index] = -(log_k[:, None] * torch.ones_like(x))
    is_masked = (x == mask_index).to(model_output.dtype)[:, :, None]
    score = (masked * is_masked + unmasked * (1 - is_masked)).exp()
    stag = score.clone()
    extra_const = (1 - dsigma.exp()) * stag.sum(dim=-1)
    stag *= dsigma.exp()[:, None]
    stag[..., mask_index] += extra_const
    sig = dsigma.view(*dsigma.shape, 1)
    edge = torch.exp(-sig) * F.one_hot(x, num_classes=V)
    edge += torch.where(x == mask_index, 1 - torch.exp(-sig).squeeze(-1), 0)[..., None]
    return stag * edge


def _top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_logits, sorted_indices = torch.sort(logits, descending=True)
    cumulative_probs = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1)
    sorted_indices_to_remove = cumulative_probs > top_p
    sorted_indices_to_remove[..., 1:] = sorted_indices_to_remove[..., :-1].clone()
    sorted_indices_to_remove[..., 0] = 0
    indices_to_remove = sorted_indices_to_remove.scatter(-1, sorted_indices, sorted_indices_to_remove)
    return logits.masked_fill(indices_to_remove, float("-inf"))


def reference_duo_sample(sd: dict, n_heads: int, prompt: torch.Tensor, gen_length: int, vocab: int, steps: int,
                         noise_removal: str | None, use_float64: bool, p_nucleus: float, eps: float = 1e-5
                         ) -> torch.Tensor:
    """Duo ch-1 `generate_samples` (prior `randint` over the generated positions, prompt restored each update)."""
    B, P = prompt.shape
    x = torch.cat([prompt, torch.randint(0, vocab, (B, gen_length))], dim=1)

    def alpha(t):
        return 1 - (1 - 1e-3) * t

    def update(x, t, alpha_s):
        alpha_t = alpha(t)
        x0 = torch.log_softmax(reference_forward(sd, n_heads, x, -torch.log(alpha_t).squeeze(-1)), -1).exp()
        if use_float64:
            x0 = x0.to(torch.float64)
        a_t, a_s = alpha_t[:, :, None].to(x0.dtype), alpha_s[:, :, None].to(x0.dtype)
        xt_one_hot = F.one_hot(x, vocab).to(x0.dtype)
        nums = (a_t * vocab * x0 * xt_one_hot + (a_t / a_s - a_t) * xt_one_hot + (a_s - a_t) * x0
                + (1 - a_t / a_s) * (1 - a_s) / vocab)
        q = nums / (a_t * vocab * torch.gather(x0, -1, x[..., None]) + (1 - a_t))
        if p_nucleus < 1:
            q = _top_p(q.log(), p_nucleus)
        new = _sample_categorical(q)
        new[:, :P] = prompt
        return new

    timesteps = torch.linspace(1, eps, steps + 1)
    dt = (1 - eps) / steps
    for i in range(steps):
        t = timesteps[i] * torch.ones(B, 1)
        x = update(x, t, alpha(t - dt))
    t = timesteps[-1] * torch.ones(B, 1)
    if noise_removal == "ancestral":
        x = update(x, t, torch.ones_like(t))
    elif noise_removal == "greedy":
        out = reference_forward(sd, n_heads, x, -torch.log(alpha(t)).squeeze(-1)).argmax(-1)
        x = torch.cat([prompt, out[:, P:]], dim=1)
    return x
