"""The dtype the precision-sensitive steps compute in: RMSNorm statistics (and the per-head q/k norm), the softmax
of the attention pattern, LLaDA's full-precision rotary and the rotary tables (`HookedMDM._rotary`).

The references (transformers, vLLM) write these steps as `.to(torch.float32)` / `dtype=torch.float32`: an upcast
for bf16 / fp16 / fp32 models, but a *downcast* for a float64 one, which then is no longer float64 (and two
implementations that round the same fp32 quantity differently, `x / sqrt(v)` against `x * rsqrt(v)`, drift apart
by ~1e-6 of the logit scale on a tiny model and ~1e-4 at d_model 256). mdm_lens computes them in fp32 for every
dtype but float64 (bit-identical to the references there), and in float64 for float64 models, so a float64 run
agrees with a float64 reference to ~1e-12.
"""

from __future__ import annotations

import torch
from torch import Tensor


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64, else fp32 (the references' fp32 upcast for bf16 / fp16, and fp32 itself)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def at_least_fp32(x: Tensor) -> Tensor:
    """`x` in `compute_dtype(x.dtype)`: `x.float()` except that float64 stays float64."""
    return x.to(compute_dtype(x.dtype))
