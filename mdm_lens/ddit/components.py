"""The DDiT building blocks (MDLM / BD3LM / Duo / GIDD-DiT lineage) with TransformerLens-style hook points.

Transcribed from the reference math (shared/specs/families-2.md §1): weight-only LayerNorm computed in fp32,
adaLN modulation `x * (1 + scale) + shift` from a conditioning vector, rotary on q and k only (rotate-half over the
full head), bidirectional softmax attention, a GELU-tanh MLP with biases, and gated residual adds
`resid + gate * branch` (the product is formed first, as the reference's `bias_dropout_add_scale` does)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from mdm_lens.config import MDMConfig
from mdm_lens.precision import at_least_fp32, compute_dtype

FREQ_DIM = 256  # the timestep embedder's sinusoidal width (frequency_embedding_size), fixed in every reference
MAX_PERIOD = 10000


def modulate(x: Tensor, shift: Float[Tensor, "batch d_model"], scale: Float[Tensor, "batch d_model"]) -> Tensor:
    # the reference's modulate_fused receives [B, 1, D] operands; ours are [B, D] and get the position axis here
    return x * (1 + scale[:, None]) + shift[:, None]


def timestep_frequencies(sigma: Float[Tensor, "batch"]) -> Float[Tensor, "batch 256"]:
    """cos first, then sin, of σ times 128 geometric frequencies: fp32 like the reference, float64 for a float64 σ
    (a float64 model's: `mdm_lens.precision`)."""
    half, dtype = FREQ_DIM // 2, compute_dtype(sigma.dtype)
    freqs = torch.exp(-math.log(MAX_PERIOD) * torch.arange(0, half, dtype=dtype, device=sigma.device) / half)
    args = sigma[:, None].to(dtype) * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class DDiTEmbed(nn.Module):
    """The token embedding `W_E` [d_vocab, d_model] as a module of its own (TL's `embed.W_E`): a device map places
    it like any other module, and under disk offload accelerate loads its weight when it is called."""

    def __init__(self, cfg: MDMConfig):
        super().__init__()
        self.W_E = nn.Parameter(torch.empty(cfg.d_vocab, cfg.d_model, dtype=cfg.dtype))

    def forward(self, tokens: Tensor) -> Float[Tensor, "batch pos d_model"]:
        return self.W_E[tokens]


class TimestepEmbedder(nn.Module):
    """σ → 256 frequency features → Linear → SiLU → Linear (`hook_time_embed` sees the MLP output; the caller's
    outer SiLU gives the conditioning vector)."""

    def __init__(self, cfg: MDMConfig):
        super().__init__()
        cond = cfg.extra["cond_dim"]
        self.fc1 = nn.Linear(FREQ_DIM, cond, dtype=cfg.dtype)
        self.fc2 = nn.Linear(cond, cond, dtype=cfg.dtype)
        self.hook_freqs = HookPoint()  # [batch, 256]

    def forward(self, sigma: Float[Tensor, "batch"]) -> Float[Tensor, "batch cond"]:
        f = self.hook_freqs(timestep_frequencies(sigma)).to(self.fc1.weight.dtype)
        return self.fc2(F.silu(self.fc1(f)))


class WeightLayerNorm(nn.Module):
    """LayerNorm without bias: `layer_norm(x.float()) * w` (eps 1e-5; float64 stays float64,
    `mdm_lens.precision`); `hook_normalized` sees the product."""

    def __init__(self, cfg: MDMConfig):
        super().__init__()
        self.w = nn.Parameter(torch.empty(cfg.d_model, dtype=cfg.dtype))
        self.eps = cfg.norm_eps
        self.hook_normalized = HookPoint()  # [batch, pos, d_model]

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        # the references disable autocast around the norm: fp32 under the bf16 autocast path too
        with torch.autocast(device_type=x.device.type, enabled=False):
            n = F.layer_norm(at_least_fp32(x), (x.shape[-1],), eps=self.eps)
            return self.hook_normalized(n * self.w.to(n.dtype))


class AdaLN(nn.Module):
    """`Linear(cond → k·d_model)` chunked into named modulation vectors, each with its own hook ([batch, d_model])."""

    def __init__(self, cfg: MDMConfig, names: tuple[str, ...]):
        super().__init__()
        self.names = names
        self.linear = nn.Linear(cfg.extra["cond_dim"], len(names) * cfg.d_model, dtype=cfg.dtype)
        for n in names:
            setattr(self, f"hook_{n}", HookPoint())

    def forward(self, c: Float[Tensor, "batch cond"]) -> dict[str, Float[Tensor, "batch d_model"]]:
        parts = self.linear(c).chunk(len(self.names), dim=-1)
        return {n: getattr(self, f"hook_{n}")(p) for n, p in zip(self.names, parts)}


def softmax_keys(scores: Tensor) -> Tensor:
    """The explicit path's softmax over keys in fp32 (float64 stays float64), returned in the scores' dtype: a bf16
    model's pattern is not a bf16 softmax (the references' autocast runs softmax in fp32; SDPA accumulates in fp32)."""
    return torch.softmax(scores, dim=-1, dtype=compute_dtype(scores.dtype)).to(scores.dtype)


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary_tables(n_pos: int, d_head: int, theta: float, device: torch.device, dtype: torch.dtype = torch.float32
                  ) -> tuple[Tensor, Tensor]:
    """cos/sin `[pos, d_head]` (`cat(freqs, freqs)`) in `dtype` (fp32, or float64 for a float64 model:
    `mdm_lens.precision.compute_dtype`), rebuilt from frequencies in that dtype whatever the weights' dtype: the
    reference's persistent `inv_freq` buffer would quantise positions if cast to bf16 (trap T1.2)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, d_head, 2, device=device).to(dtype) / d_head))
    freqs = torch.outer(torch.arange(n_pos, device=device, dtype=dtype), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class DDiTAttention(nn.Module):
    """Packed qkv (columns q | k | v, head-major), rotary on q and k, unmasked softmax attention, output proj."""

    def __init__(self, cfg: MDMConfig):
        super().__init__()
        self.cfg = cfg
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False, dtype=cfg.dtype)
        self.out = nn.Linear(cfg.d_model, cfg.d_model, bias=False, dtype=cfg.dtype)
        for name in ("q", "k", "v", "rot_q", "rot_k", "attn_scores", "pattern", "z", "out"):
            setattr(self, f"hook_{name}", HookPoint())
        # True: always the explicit path (benchmarks; nnsight swaps in a gate that is true at traced steps)
        self.force_explicit: object = False

    def _needs_pattern(self) -> bool:
        return bool(self.force_explicit) or bool(self.hook_attn_scores.fwd_hooks or self.hook_pattern.fwd_hooks)

    def forward(self, x: Float[Tensor, "batch pos d_model"], cos: Tensor, sin: Tensor
                ) -> Float[Tensor, "batch pos d_model"]:
        b, p, _ = x.shape
        h, d = self.cfg.n_heads, self.cfg.d_head
        q, k, v = self.qkv(x).view(b, p, 3, h, d).unbind(dim=2)
        q, k, v = self.hook_q(q), self.hook_k(k), self.hook_v(v)
        cos, sin = cos.to(q.dtype)[None, :, None], sin.to(q.dtype)[None, :, None]
        q = self.hook_rot_q(q * cos + rotate_half(q) * sin)
        k = self.hook_rot_k(k * cos + rotate_half(k) * sin)
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))  # [batch, head, pos, d_head]
        if self._needs_pattern():
            scores = self.hook_attn_scores(qh @ kh.transpose(-1, -2) / math.sqrt(d))
            pattern = self.hook_pattern(softmax_keys(scores))
            z = pattern @ vh
        else:  # nothing observes the pattern: the fused kernel (same math)
            z = F.scaled_dot_product_attention(qh, kh, vh)
        z = self.hook_z(z.transpose(1, 2))  # [batch, pos, head, d_head]
        return self.hook_out(self.out(z.reshape(b, p, h * d)))


class DDiTMLP(nn.Module):
    def __init__(self, cfg: MDMConfig):
        super().__init__()
        self.fc_in = nn.Linear(cfg.d_model, cfg.d_mlp, dtype=cfg.dtype)
        self.fc_out = nn.Linear(cfg.d_mlp, cfg.d_model, dtype=cfg.dtype)
        self.hook_pre, self.hook_post, self.hook_out = HookPoint(), HookPoint(), HookPoint()

    def forward(self, x: Float[Tensor, "batch pos d_model"]) -> Float[Tensor, "batch pos d_model"]:
        pre = self.hook_pre(self.fc_in(x))
        post = self.hook_post(F.gelu(pre, approximate="tanh"))
        return self.hook_out(self.fc_out(post))


BLOCK_MODULATION = ("shift_msa", "scale_msa", "gate_msa", "shift_mlp", "scale_mlp", "gate_mlp")


class DDiTBlock(nn.Module):
    """One block. Hooks: `hook_resid_pre`, `adaLN.hook_{shift,scale,gate}_{msa,mlp}`, `ln1.hook_normalized`,
    `hook_modulated` (attention input), `attn.*`, `hook_attn_out` (gate·attention output, what the residual gets),
    `hook_resid_mid`, `ln2.hook_normalized`, `hook_modulated_mlp`, `mlp.hook_pre/hook_post/hook_out`,
    `hook_mlp_out` (gate·MLP output), `hook_resid_post`."""

    def __init__(self, cfg: MDMConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.adaLN = AdaLN(cfg, BLOCK_MODULATION)
        self.ln1, self.ln2 = WeightLayerNorm(cfg), WeightLayerNorm(cfg)
        self.attn, self.mlp = DDiTAttention(cfg), DDiTMLP(cfg)
        for name in ("resid_pre", "modulated", "attn_out", "resid_mid", "modulated_mlp", "mlp_out", "resid_post"):
            setattr(self, f"hook_{name}", HookPoint())

    def forward(self, resid: Tensor, c: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        resid = self.hook_resid_pre(resid)
        m = self.adaLN(c)
        # the norm and the modulation compute in fp32; the branch input takes the weights' dtype (what the
        # references' bf16 autocast does at the linear), so a bf16 / fp16 model runs in its own dtype
        u = modulate(self.ln1(resid), m["shift_msa"], m["scale_msa"]).to(self.attn.qkv.weight.dtype)
        attn = self.hook_attn_out(m["gate_msa"][:, None] * self.attn(self.hook_modulated(u), cos, sin))
        resid = self.hook_resid_mid(resid + attn)
        u = modulate(self.ln2(resid), m["shift_mlp"], m["scale_mlp"]).to(self.mlp.fc_in.weight.dtype)
        mlp = self.hook_mlp_out(m["gate_mlp"][:, None] * self.mlp(self.hook_modulated_mlp(u)))
        return self.hook_resid_post(resid + mlp)

