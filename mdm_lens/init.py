"""Random weights that look trained.

A random model whose norm weights are 1 and whose biases are 0 hides every bug that drops a norm weight, a bias,
a router bias or a conditioning term: multiplying by 1 or adding 0 is invisible. `realistic_` redraws those
parameters the way trained checkpoints have them (norm weights log-normal around 1 and spread by a factor of ~2,
biases and router biases of the matrices' own order), so a dropped or misplaced one changes the output. It is the
one fixture every test that builds a random model uses (`HookedMDM.from_config(..., init="realistic")`).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from mdm_lens import validate
from mdm_lens.config import TL_CONSTANTS, check_tl_constants

#: log-normal spread of the norm weights: exp(N(0, 0.5²)) lies in [0.37, 2.7] for 95% of entries,
#: so |w - 1| is ~0.4 on average (trained RMSNorm weights span a wider range still).
NORM_LOG_STD = 0.5


def norm_weight_draw(shape: tuple[int, ...] | torch.Size, generator: torch.Generator) -> torch.Tensor:
    """Norm (or scale) weights the way trained models have them: exp(N(0, NORM_LOG_STD²)), positive, far from 1.
    The one definition the test builders share (hub-layout state dicts, transformers references, the bridge)."""
    return torch.exp(NORM_LOG_STD * torch.randn(tuple(shape), generator=generator))


def bias_draw(shape: tuple[int, ...] | torch.Size, std: float, generator: torch.Generator) -> torch.Tensor:
    """Biases and router/expert biases: normal(0, std), std >= 0.1 in the fixtures so a dropped one shows."""
    return std * torch.randn(tuple(shape), generator=generator)


def from_config_args(cfg: Any, init: Any, init_std: Any) -> tuple[Any, str, float]:
    """`HookedMDM.from_config`'s own checks: a TransformerLens field HookedMDM never computes another way (act_fn,
    attn_only, normalization_type, positional_embedding_type) and `init_std` > 0 (a negative std would flip every
    weight's sign; NaN was refused under the name bias_std). Returns a copy of `cfg` for the new model: a config
    shared with another model (`from_config(m.cfg)`) would carry one model's `process_weights_` into the other."""
    check_tl_constants({k: getattr(cfg, k) for k in TL_CONSTANTS})
    return (copy.deepcopy(cfg), validate.choice(init, ("normal", "realistic"), name="init"),
            validate.number(init_std, name="init_std", min=0, min_open=True))


def _is_norm_weight(name: str) -> bool:
    return name.endswith(".w") or name.endswith("norm.weight")


def realistic_(model: nn.Module, seed: int = 0, bias_std: float | None = None) -> nn.Module:
    """Redraw, in place, every norm weight (log-normal around 1, sign kept positive as in trained models), every
    bias parameter and every registered router/expert bias buffer (normal, `bias_std`, default 0.1 or the largest
    matrix std, whichever is larger). Matrices are left as they are. Returns `model`."""
    validate.seed(seed)
    gen = torch.Generator().manual_seed((seed + 7919) % 2**64)  # other draws than the matrices' under the same seed
    with torch.no_grad():
        if bias_std is None:
            stds = [float(p.float().std()) for n, p in model.named_parameters()
                    if p.ndim >= 2 and p.numel() > 1 and not _is_norm_weight(n)]
            bias_std = max([0.1] + [s for s in stds if s == s])
        bias_std = validate.number(bias_std, name="bias_std", min=0.0)
        for name, p in model.named_parameters():
            if _is_norm_weight(name) and p.ndim == 1:
                p.copy_(norm_weight_draw(p.shape, gen).to(p.dtype))
            elif "bias" in name.rsplit(".", 1)[-1] and p.ndim == 1:
                p.copy_(bias_draw(p.shape, bias_std, gen).to(p.dtype))
        for name, b in model.named_buffers():
            if name.endswith("expert_bias") and b.is_floating_point():
                b.copy_(bias_draw(b.shape, bias_std, gen).to(b.dtype))
    return model
