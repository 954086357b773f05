"""Rigged models for sampler tests: a HookedMDM whose unembedding is the identity on the first d_vocab residual
dimensions, plus a hook on `ln_final.hook_normalized` that writes designed logits. The samplers run their real
code on it; only the numbers they read are planted.

`designed(state)` returns the *aligned* logits `[batch, pos, vocab]` (row p predicts token p) for the canvas in
`model.state`; for Dream-style models (`logit_shift`) the hook writes them one row earlier, since aligned row p is
raw row p-1."""

from __future__ import annotations

from typing import Callable

import torch

from mdm_lens import HookedMDM, MDMConfig, at_steps, steps

V = 50  # vocabulary
MASK = 49
EOS, EOT = 1, 2


def rigged(kind: str = "llada", vocab: int = V, mask: int = MASK, **extra) -> HookedMDM:
    cfg = MDMConfig(d_model=64, n_layers=1, n_heads=2, n_kv_heads=2, d_mlp=32, d_vocab=vocab, mask_token_id=mask,
                    attention="causal" if kind == "arm" else "bidirectional", logit_shift=kind == "dream",
                    n_ctx=32, eos_token_id=EOS, extra=dict(extra))
    # planted: the rig replaces ln_final.hook_normalized, which comes before ln_final.w (unit norms keep the
    # designed logits as designed)
    model = HookedMDM.from_config(cfg, seed=0, init_std=0.1, init="normal")
    with torch.no_grad():
        model.unembed.weight.zero_()
        model.unembed.weight[:, :vocab].copy_(torch.eye(vocab))
    return model


def rig(model: HookedMDM, designed: Callable) -> object:
    """A step hook (both CFG phases) that replaces the final normalized residual with the designed logits."""
    vocab = model.cfg.d_vocab

    def hook(x, hook):
        state = model.state
        logits = designed(state).to(x.dtype)
        if model.cfg.logit_shift:  # aligned row p is raw row p-1
            logits = torch.cat([logits[:, 1:], torch.zeros_like(logits[:, :1])], dim=1)
        out = torch.zeros_like(x)
        out[..., :vocab] = logits
        return out

    return at_steps(hook, steps(phases=("cond", "uncond")), name="ln_final.hook_normalized")


def spread(top: dict[int, float], vocab: int = V) -> torch.Tensor:
    """Log-probabilities of a distribution with the given top tokens and the rest of the mass spread evenly."""
    p = torch.zeros(vocab, dtype=torch.float64)
    others = [t for t in range(vocab) if t not in top]
    p[others] = (1 - sum(top.values())) / len(others)
    for t, q in top.items():
        p[t] = q
    return p.log().float()


def static(rows: dict[int, torch.Tensor], vocab: int = V) -> Callable:
    """Designed logits that do not depend on the canvas: `rows[pos]` at those positions, zeros elsewhere."""

    def designed(state):
        b, t = state.x.shape
        out = torch.zeros(b, t, vocab)
        for pos, row in rows.items():
            if pos < t:
                out[:, pos] = row
        return out

    return designed


def identity_unembed(model: HookedMDM, scale: float = 3.0) -> HookedMDM:
    """The unembedding as `scale` × the identity on the first d_vocab residual dimensions (d_model >= d_vocab) and a
    unit final-norm weight, so a hook on `ln_final.hook_normalized` can pin single logits (see `no_mask_hooks`)."""
    vocab = model.cfg.d_vocab
    with torch.no_grad():
        model.unembed.weight.zero_()
        model.unembed.weight[:, :vocab].copy_(scale * torch.eye(vocab))
        model.ln_final.w.fill_(1.0)
    return model


def no_mask_hooks(mask: int) -> list[tuple[str, Callable]]:
    """On an `identity_unembed` model: its own logits, except that the mask id is never predicted (pinned at -30).
    A random model can otherwise sample the mask id, and a slot then stays masked after its commit, which no
    sampler's schedule accounts for. Pass the hooks to every run and every reference forward."""
    def no_mask(x, hook):
        x = x.clone()
        x[..., mask] = -30.0
        return x

    return [("ln_final.hook_normalized", no_mask)]
