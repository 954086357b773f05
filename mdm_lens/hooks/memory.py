"""Shape and byte estimates for hook activations, so a cache is refused *before* the run when it
would not fit, with the reducer to use instead."""

from __future__ import annotations

import math
import os
import re

from mdm_lens.config import MDMConfig
from mdm_lens.errors import ArgumentError, InputError, MemoryBudgetError
from mdm_lens.hooks import shape_probe

DEFAULT_BUDGET = 4 * 2**30
BUDGET_ENV = "MDM_LENS_CACHE_BUDGET_GB"


def env_amount(var: str, *, unit: str) -> float | None:
    """A positive, finite amount from environment variable `var` (e.g. a budget in GiB), read when called so a
    running notebook can change it; None when unset or blank. A bad value names the variable and its raw text."""
    raw = os.environ.get(var)
    if raw is None or not raw.strip():
        return None
    try:
        amount = float(raw)
    except ValueError:
        raise ArgumentError(f"{var}={raw!r} is not a number of {unit}.", argument=var, value=raw,
                            allowed=f"a positive number ({unit})") from None
    if not (amount > 0 and math.isfinite(amount)):
        raise ArgumentError(f"{var}={raw!r} must be a positive, finite number of {unit}.", argument=var, value=raw,
                            allowed=f"a positive number ({unit})")
    return amount


def cache_budget() -> tuple[int, str]:
    """The trajectory cache's default budget in bytes and where it came from: `MDM_LENS_CACHE_BUDGET_GB` read when
    the cache is made (so setting it in a running notebook takes effect), else 4 GiB."""
    gib = env_amount(BUDGET_ENV, unit="GiB")
    if gib is None:
        return DEFAULT_BUDGET, "the default"
    return max(1, int(gib * 2**30)), f"{BUDGET_ENV}={os.environ[BUDGET_ENV]}"


_SUFFIX_SHAPES = {
    "hook_embed": "bpd", "hook_resid_pre": "bpd", "hook_resid_mid": "bpd", "hook_resid_post": "bpd",
    "hook_attn_out": "bpd", "hook_mlp_out": "bpd", "hook_scale": "bp1", "hook_normalized": "bpd",
    "attn.hook_q": "bphe", "attn.hook_rot_q": "bphe", "attn.hook_k": "bpge", "attn.hook_rot_k": "bpge",
    "attn.hook_v": "bpge", "attn.hook_z": "bphe", "attn.hook_result": "bphd",
    "attn.hook_attn_scores": "bhpp", "attn.hook_pattern": "bhpp",
    "mlp.hook_pre": "bpf", "mlp.hook_pre_linear": "bpf", "mlp.hook_post": "bpf",
}

ALTERNATIVES = {
    "bhpp": "record a reducer instead, e.g. `record=[ReceivedAttention()]` ([step, batch, layer, head, key]) or "
            "`TopKKeys(k=4)`, which read the pattern a query chunk at a time and never hold it; or cache fewer "
            "layers/steps",
}


def hook_shape(cfg: MDMConfig, name: str, batch: int, pos: int) -> tuple[int, ...]:
    """The shape of a hook of the shared dense surface (the names every model class has, the bridge's included);
    any other hook point is measured on the model (`hooks.shape_probe.measure`) and passed as `measured`."""
    for suffix, letters in sorted(_SUFFIX_SHAPES.items(), key=lambda kv: -len(kv[0])):
        if _is_dense(name, suffix):
            dims = {"b": batch, "p": pos, "d": cfg.d_model, "h": cfg.n_heads, "g": cfg.n_key_value_heads,
                    "e": cfg.d_head, "f": cfg.d_mlp, "1": 1}
            return tuple(dims[c] for c in letters)
    raise InputError(f"no shape is known for hook {name!r} without measuring it on the model; pass "
                     "measured=shape_probe.measure(model, names).", argument="names", value=name,
                     allowed="a dense-surface hook name, or a measured shape")


def _is_dense(name: str, suffix: str) -> bool:
    """`name` is the dense hook `suffix` of a block (or the model), not a sub-module's hook with the same ending
    (`mlp.experts.0.hook_post` is an expert's [routed row, d_expert], not the dense `mlp.hook_post`)."""
    if not name.endswith(suffix):
        return False
    head = name[: len(name) - len(suffix)]
    return head == "" or re.fullmatch(r"(blocks\.\d+\.)?(ln1\.|ln2\.|ln_final\.)?", head) is not None


def is_dense_hook(name: str) -> bool:
    """Whether `name` is on the dense surface whose shapes `hook_shape` knows from the config."""
    return any(_is_dense(name, suffix) for suffix in _SUFFIX_SHAPES)


def estimate_bytes(cfg: MDMConfig, names: list[str], n_steps: int, batch: int, pos: int, dtype_bytes: int,
                   measured: dict[str, tuple] | None = None, itemsize: dict[str, int] | None = None) -> int:
    """Bytes of `names` over `n_steps` forwards of `batch` × `pos`: measured axes (`shape_probe.measure`) where
    given, with their measured bytes per element (`itemsize`), else the dense table at `dtype_bytes`."""
    measured, itemsize = measured or {}, itemsize or {}
    total = 0
    for name in names:
        if name in measured:
            n = shape_probe.size(measured[name], batch, pos)
        else:
            n = 1
            for d in hook_shape(cfg, name, batch, pos):
                n *= d
        total += n * itemsize.get(name, dtype_bytes)
    return total * n_steps


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def check_budget(cfg: MDMConfig, names: list[str], n_steps: int, batch: int, pos: int, dtype_bytes: int,
                 budget: int, measured: dict[str, tuple] | None = None, itemsize: dict[str, int] | None = None,
                 source: str = "budget_bytes") -> int:
    need = estimate_bytes(cfg, names, n_steps, batch, pos, dtype_bytes, measured, itemsize)
    if need > budget:
        quadratic = [n for n in names if re.search(r"hook_(pattern|attn_scores)$", n)]
        hint = ALTERNATIVES["bhpp"] if quadratic else "cache fewer names or steps"
        raise MemoryBudgetError(
            f"the trajectory cache would need {human(need)} ({len(names)} hook(s) × {n_steps} step(s), batch {batch}, "
            f"{pos} positions) but the budget is {human(budget)} ({source}). {hint[0].upper() + hint[1:]}. Raise the "
            f"budget with `TrajectoryCache(..., budget_bytes=…)` or {BUDGET_ENV} (read when a cache is made) if you "
            "really have the memory."
        )
    return need


def pattern_transient_bytes(cfg: MDMConfig, batch: int, pos: int, query_chunk: int | None, dtype_bytes: int = 4,
                            masked: bool = False) -> int:
    """Upper bound on the bytes of pattern buffers one attention layer holds at once while reducers read it.

    Full path (`query_chunk=None`), per `[batch, head, T, T]`: the scores in the model dtype, the fp32
    softmax, and with a mask the masked copy of the scores and the NaN-cleaned softmax, plus the model-dtype
    pattern when that is not fp32. Chunked path: the same buffers for `query_chunk` rows, `[batch, head,
    chunk, T]`: linear in T for a fixed chunk (what `hook_pattern` caches are refused for)."""
    rows = pos if query_chunk is None else min(query_chunk, pos)
    one = batch * cfg.n_heads * rows * pos
    per = (dtype_bytes + 4) * (1 + int(masked)) + (dtype_bytes if dtype_bytes != 4 else 0)
    return one * per
