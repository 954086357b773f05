"""Issue #29: MDLM / Duo (HookedDDiT) cost. (a) one forward of HookedDDiT vs a plain-torch transcription of the
reference DDiT forward (packed qkv in the reference's `b s three h d` layout, rotary over the qkv stack with the v
slot held at identity, per-row full attention as flash-attn's varlen call computes it) on the same weights, goal
≤ 1.05; (b) an MDLM trajectory (predictor "ddpm": a forward every step) with a step hook on every block's residual
at every step vs the same trajectory without hooks, goal ≤ 1.3. Ratios only; nothing is asserted.

    python -m benchmarks --only ddit --repeats 11
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.harness import Row, alternate, seconds

SIZES = {"full": dict(d=256, layers=4, heads=4, cond=128, vocab=2048, seq=256, batch=4, steps=16),
         "tiny": dict(d=32, layers=2, heads=2, cond=16, vocab=64, seq=16, batch=2, steps=4)}


def _model(kind: str, sz: dict) -> Any:
    from mdm_lens.ddit import HookedDDiT, ddit_config

    cfg = ddit_config(kind, d_vocab=sz["vocab"], n_ctx=sz["seq"], d_model=sz["d"], cond_dim=sz["cond"],
                      n_layers=sz["layers"], n_heads=sz["heads"], time_conditioning=kind == "duo")
    return HookedDDiT.from_config(cfg, seed=0)


def _ln(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x.float(), [x.shape[-1]]) * w


def reference_forward(m: Any, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """The reference DDiT forward on `m`'s parameters (eval mode, fp32)."""
    B, L = x.shape
    H = m.cfg.n_heads
    if not m.cfg.extra["time_conditioning"]:
        sigma = torch.zeros_like(sigma)
    half = 128
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32) / half)
    args = sigma[:, None].float() * freqs[None]
    t = m.time_embed
    c = F.silu(t.fc2(F.silu(t.fc1(torch.cat([torch.cos(args), torch.sin(args)], -1)))))
    hd = m.cfg.d_head
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
    emb = torch.cat([torch.outer(torch.arange(L).float(), inv)] * 2, -1)
    cos = emb.cos()[None, :, None, None].repeat(1, 1, 3, 1, 1)
    sin = emb.sin()[None, :, None, None].repeat(1, 1, 3, 1, 1)
    cos[:, :, 2], sin[:, :, 2] = 1.0, 0.0
    h = m.W_E[x]
    for blk in m.blocks:
        mods = blk.adaLN.linear(c)[:, None].chunk(6, dim=2)
        u = _ln(h, blk.ln1.w) * (1 + mods[1]) + mods[0]
        qkv = blk.attn.qkv(u).view(B, L, 3, H, hd)
        x1, x2 = qkv.chunk(2, dim=-1)
        qkv = qkv * cos + torch.cat((-x2, x1), -1) * sin
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, L, -1)
        h = h + mods[2] * blk.attn.out(a)
        u = _ln(h, blk.ln2.w) * (1 + mods[4]) + mods[3]
        h = h + mods[5] * blk.mlp.fc_out(F.gelu(blk.mlp.fc_in(u), approximate="tanh"))
    shift, scale = m.final_adaLN.linear(c)[:, None].chunk(2, dim=2)
    return m.unembed(_ln(h, m.ln_final.w) * (1 + scale) + shift)


def run(size: str, reps: int, traj_reps: int) -> list[Row]:
    sz = SIZES[size]
    rows = []
    for kind in ("mdlm", "duo"):
        m = _model(kind, sz)
        x = torch.randint(0, sz["vocab"] - 1, (sz["batch"], sz["seq"]), generator=torch.Generator().manual_seed(1))
        sigma = torch.full((sz["batch"],), 0.7)
        ours, ref = m(x, sigma=sigma), reference_forward(m, x, sigma)
        err = float((ours - ref).abs().max() / ref.abs().max())
        if not err <= 1e-5:  # timing two computations that disagree would mean nothing
            raise AssertionError(f"{kind}: HookedDDiT and the reference transcription differ (max rel err {err:.1e})")
        t = alternate(lambda: m(x, sigma=sigma), lambda: reference_forward(m, x, sigma), reps)
        rows.append(Row("ddit forward", f"{kind} HookedDDiT vs reference transcription", seconds(min(t.a)),
                        seconds(min(t.b)), t.ratio, "≤ 1.05", t.ratio <= 1.05, f"max rel err {err:.1e}"))
    m = _model("mdlm", sz)
    prompt = torch.randint(0, sz["vocab"] - 1, (sz["batch"], 4), generator=torch.Generator().manual_seed(2))
    kw = dict(steps=sz["steps"], gen_length=sz["seq"] - 4, predictor="ddpm", seed=0, progress=False)
    sink: list[float] = []
    hooks = [(f"blocks.{i}.hook_resid_post", lambda t, hook: sink.append(0.0)) for i in range(sz["layers"])]
    t = alternate(lambda: m.generate(prompt, fwd_hooks=hooks, **kw), lambda: m.generate(prompt, **kw), traj_reps)
    rows.append(Row("ddit trajectory", f"mdlm {sz['steps']} steps, a hook on every block at every step vs none",
                    seconds(min(t.a)), seconds(min(t.b)), t.ratio, "≤ 1.3", t.ratio <= 1.3))
    return rows
