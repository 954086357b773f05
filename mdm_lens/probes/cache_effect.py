"""What an approximate KV cache changes: along one cached trajectory (`generate(..., kv_cache="prefix"|"dual")`),
each window step's cached forward against a fresh uncached forward on the same canvas.

    out = model.generate(prompt, gen_length=64, block_length=16, steps=64, kv_cache="dual")
    effect = probes.cache_effect(model, out)          # tidy table, one row per (step, layer, metric)
    effect.table.pivot_table(index="layer", columns="metric", values="value")

The cached forward is rebuilt exactly as the sampler ran it (stale keys/values of the block-start canvas put back
through hooks at the positions outside the window; equal to `mdm_lens.kvcache` to rounding, see
tests/test_kv_cache.py). Per step and layer:

* `k_drift`, `v_drift`: ‖stale − fresh‖ / ‖fresh‖ over the cached positions (Frobenius, all kv heads);
  `k_cosine`, `v_cosine`: the mean cosine of stale and fresh vectors per position and kv head;
* `received_tv`: total-variation distance between the head-mean attention the window's query rows pay each key,
  cached vs fresh (`mass`, as `ReceivedAttention`);
* `anchor_jaccard`: Jaccard of the anchor sets (`detect_anchors`, z-score rule, on those head means); two empty
  sets are undefined: NaN with the reason;
* `patch_logprob` (with `patch=True`): the mean log-probability of the run's final tokens at the window's masked
  positions when only this layer's cached positions are stale, minus the fully fresh value — where staleness
  matters (layer -1 rows carry `logprob_fresh`, `logprob_cached` and their difference `logprob_delta`).

Retrieval-head copy scores under the cache are not computed here yet.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import pandas as pd
import torch
from torch import Tensor

from mdm_lens import validate
from mdm_lens.errors import InputError
from mdm_lens.kvcache import MODES
from mdm_lens.probes.floating import detect_anchors

METRICS = ("k_drift", "v_drift", "k_cosine", "v_cosine", "received_tv", "anchor_jaccard", "patch_logprob")


@dataclass
class CacheEffect:
    """`.table` / `.to_frame()`: the tidy table (one row per measurement)."""

    table: pd.DataFrame  # step, block, layer, metric, value, reason (layer -1: whole-model rows)
    kv_cache: str

    def to_frame(self) -> pd.DataFrame:
        return self.table.copy()

    def __repr__(self) -> str:
        steps = self.table["step"].nunique() if len(self.table) else 0
        return f"CacheEffect(kv_cache={self.kv_cache!r}, steps={steps}, rows={len(self.table)})"


def _windows(out: Any) -> list[tuple[int, int, int, int]]:
    """(step, its block's refresh step, window start, window end) for every cached (non-refresh) step."""
    s = out.settings
    blocks = out.trajectory.block_of_step.tolist()
    total = out.tokens.shape[1]
    rows, refresh = [], 0
    for step, b in enumerate(blocks):
        if step == 0 or b != blocks[step - 1]:
            refresh = step
            continue
        lo = out.prompt_length + b * s["block_length"]
        hi = total if s["kv_cache"] == "prefix" else lo + s["block_length"]
        rows.append((step, refresh, lo, hi))
    return rows


def _kv_names(layers: Sequence[int]) -> list[str]:
    return [f"blocks.{l}.attn.{h}" for l in layers for h in ("hook_rot_k", "hook_v")]


def _capture(model: Any, x: Tensor, layers: Sequence[int], fwd_hooks: list) -> tuple[Tensor, dict[str, Tensor]]:
    names = set(_kv_names(layers)) | {f"blocks.{l}.attn.hook_pattern" for l in layers}
    got: dict[str, Tensor] = {}

    def keep(t: Tensor, hook: Any) -> None:
        got[hook.name] = t.detach().clone()

    logits = model.run_with_hooks(x, return_type="aligned", fwd_hooks=fwd_hooks + [(n, keep) for n in names])
    return logits, got


def _stale_hooks(stale: dict[str, Tensor], layers: Sequence[int], keep: Tensor) -> list:
    def put(t: Tensor, hook: Any) -> Tensor:
        return torch.where(keep[None, :, None, None], t, stale[hook.name])

    return [(n, put) for n in _kv_names(layers)]


def _logprob(logits: Tensor, tokens: Tensor, positions: Tensor) -> float:
    if not bool(positions.any()):
        return float("nan")
    lp = torch.log_softmax(logits.double(), dim=-1).gather(-1, tokens[..., None])[..., 0]
    return float(lp[positions].mean())


def _received(pattern: Tensor, lo: int, hi: int) -> Tensor:
    return pattern[:, :, lo:hi].double().mean(dim=(1, 2))  # [batch, key]: head and window-row mean


def _jaccard(a: Tensor, b: Tensor) -> tuple[float, str]:
    union = int((a | b).sum())
    if union == 0:
        return float("nan"), "no anchors in either forward"
    return int((a & b).sum()) / union, ""


def _not_covered(out: Any, kv: Any) -> str:
    """Why `out` is not a run cache_effect measures: no cache at all, or another sampler's cache (BD3LM's block
    cache, Fast-dLLM v2's block cache), which it does not cover."""
    sampler = getattr(out, "sampler", None)
    covers = ("cache_effect covers the Fast-dLLM prefix / dual caches of LLaDA and Dream runs only (sampler 'llada' "
              "or 'dream' with generate(..., kv_cache='prefix'|'dual'))")
    if sampler == "sdar":  # its loop always keeps a cache, without a kv_cache setting
        return (f"{covers}; this 'sdar' run decodes against its own exact KV cache of finished blocks (no kv_cache "
                "setting), which holds what a fresh block-causal forward computes: there is no stale cache to "
                "measure.")
    if sampler in ("nemotron", "nemotron_ar"):
        return (f"{covers}; this {sampler!r} run's KV cache is how the model decodes (its causal prefill's "
                "keys / values, no kv_cache setting), not an approximation of a fresh forward: nothing to measure.")
    if sampler == "fastdllm_v2":  # kv_cache='block' is what the run did, not a setting it has
        if out.settings.get("use_block_cache"):
            return (f"{covers}; this 'fastdllm_v2' run's sub-block forwards (use_block_cache=True) read the block's "
                    "keys/values cached at the block's first forward: compare it with a use_block_cache=False run "
                    "of the same settings, whose cache of finished blocks is exact.")
        return (f"{covers}; this 'fastdllm_v2' run decodes against its own exact KV cache of finished blocks (no "
                "kv_cache setting), which holds what a fresh block-causal forward computes: there is no stale cache "
                "to measure.")
    if kv in (None, False):
        return f"{covers}; this {sampler!r} run has no KV cache (kv_cache={kv!r})."
    return (f"{covers}; this {sampler!r} run's cache (kv_cache={kv!r}) is another one, which it does not measure: "
            f"compare the run with a kv_cache=False run of the same seed instead.")


def cache_effect(model: Any, out: Any, *, layers: Sequence[int] | None = None, steps: Sequence[int] | None = None,
                 patch: bool = True, fwd_hooks: Sequence[Any] = ()) -> CacheEffect:
    """The cache's effect at each window step of the cached run `out` (see the module docstring); `steps` limits
    the steps (indices of the run), `fwd_hooks` are applied to every forward (e.g. the ones the run used)."""
    from mdm_lens.diffusion.fixed_length import require_fixed_length
    from mdm_lens.diffusion.output import require_output

    # else read as "a run without a KV cache"
    require_output(out, "cache_effect reads the GenerateOutput of a kv_cache='prefix' / 'dual' run")
    patch = validate.boolean(patch, name="patch")  # a string such as "no" is not read by its truthiness
    require_fixed_length(out, "cache_effect", "a window's cached keys would belong to rows that moved since they "
                         "were cached")
    kv = out.settings.get("kv_cache") if hasattr(out, "settings") else None
    if kv not in MODES:
        raise InputError(_not_covered(out, kv), argument="out", value=kv,
                         allowed=f"a 'llada' / 'dream' run with kv_cache in {MODES}")
    out.check_model(model)
    n = model.cfg.n_layers
    layers = validate.indices(list(range(n)) if layers is None else layers, n, name="layers", what=f"layer of {n}")
    windows = _windows(out)
    if steps is not None:
        wanted = set(validate.indices(steps, out.trajectory.n_steps, name="steps",
                                      what=f"step of a run of {out.trajectory.n_steps}"))
        comparable = sorted(w[0] for w in windows)
        refreshes = sorted(wanted - set(comparable))
        if refreshes:  # a refresh forward recomputes its cache: there is no stale cache to compare there
            raise InputError(f"cache_effect(steps={sorted(wanted)}): steps {refreshes} are the cache's refresh "
                             f"forwards (full recompute, nothing stale to compare); the window steps that read the "
                             f"cache are {comparable}.", argument="steps", value=sorted(wanted),
                             allowed=f"a subset of {comparable}")
        windows = [w for w in windows if w[0] in wanted]
    hooks = list(fwd_hooks)
    rows: list[dict[str, Any]] = []
    stale_cache: dict[int, dict[str, Tensor]] = {}
    with torch.no_grad():
        for step, refresh, lo, hi in windows:
            x = out.trajectory.x_steps[step].to(out.tokens.device)
            if refresh not in stale_cache:
                stale_cache[refresh] = _capture(model, out.trajectory.x_steps[refresh].to(x.device), range(n),
                                                hooks)[1]
            stale = stale_cache[refresh]
            keep = torch.zeros(x.shape[1], dtype=torch.bool, device=x.device)
            keep[lo:hi] = True
            fresh_logits, fresh = _capture(model, x, layers, hooks)
            cached_logits, cached = _capture(model, x, layers, hooks + _stale_hooks(stale, range(n), keep))
            target = (x == model.cfg.mask_token_id) & keep[None]
            base = dict(step=step, block=int(out.trajectory.block_of_step[step]))
            lp_fresh = _logprob(fresh_logits, out.tokens, target)
            lp_cached = _logprob(cached_logits, out.tokens, target)
            reason = "" if bool(target.any()) else "no masked position in the window"
            for metric, value in (("logprob_fresh", lp_fresh), ("logprob_cached", lp_cached),
                                  ("logprob_delta", lp_cached - lp_fresh)):
                rows.append(dict(base, layer=-1, metric=metric, value=value, reason=reason))
            for l in layers:
                rows.extend(dict(base, layer=l, metric=m, value=v, reason=r)
                            for m, v, r in _layer_rows(l, stale, fresh, cached, keep, lo, hi))
                if patch:
                    one = _stale_hooks(stale, [l], keep)
                    patched = model.run_with_hooks(x, return_type="aligned", fwd_hooks=hooks + one)
                    rows.append(dict(base, layer=l, metric="patch_logprob",
                                     value=_logprob(patched, out.tokens, target) - lp_fresh, reason=reason))
    table = pd.DataFrame(rows, columns=["step", "block", "layer", "metric", "value", "reason"])
    for col in ("step", "block", "layer"):
        table[col] = table[col].astype("Int64")
    return CacheEffect(table, kv)


def _layer_rows(l: int, stale: dict, fresh: dict, cached: dict, keep: Tensor, lo: int, hi: int) -> list[tuple]:
    out = []
    for kind, hook in (("k", "hook_rot_k"), ("v", "hook_v")):
        name = f"blocks.{l}.attn.{hook}"
        a, b = stale[name][:, ~keep].double(), fresh[name][:, ~keep].double()  # [batch, cached pos, kv_head, e]
        if a.numel() == 0:
            out += [(f"{kind}_drift", float("nan"), "no cached position"),
                    (f"{kind}_cosine", float("nan"), "no cached position")]
            continue
        out.append((f"{kind}_drift", float((a - b).norm() / b.norm()), ""))
        out.append((f"{kind}_cosine", float(torch.nn.functional.cosine_similarity(a, b, dim=-1).mean()), ""))
    rc = _received(cached[f"blocks.{l}.attn.hook_pattern"], lo, hi)
    rf = _received(fresh[f"blocks.{l}.attn.hook_pattern"], lo, hi)
    out.append(("received_tv", float(0.5 * (rc - rf).abs().sum(-1).mean()), ""))
    value, reason = _jaccard(detect_anchors(rc), detect_anchors(rf))
    out.append(("anchor_jaccard", value, reason))
    return out
