"""Item 2: a forward pass that captures every layer's attention pattern.

ours: `HookedMDM.run_with_cache(names_filter=… hook_pattern)` (the explicit attention path) vs
(a) transformers eager attention with `output_attentions=True` (non-causal),
(b) TransformerLens 4.3 `TransformerBridge.run_with_cache` on the same weights (the bridge runs
    Llama causally whatever `config.is_causal` says, so it is also compared with our *causal* twin),
(c) nnsight 0.8 tracing the eager transformers model and saving each layer's attention weights.
"""

from __future__ import annotations

from typing import Any

from benchmarks.bench_forward import check_close
from benchmarks.harness import Row, alternate, seconds
from benchmarks.models import Size, Workspace, hf_llama, random_tokens, with_attn


def is_pattern(name: str) -> bool:
    return name.endswith("hook_pattern")


def ours_fn(model: Any, ids: Any):
    def run():
        return model.run_with_cache(ids, names_filter=is_pattern)
    return run


def nnsight_fn(nn_model: Any, ids: Any, n_layers: int):
    layers = nn_model.model.layers

    def run():
        saved = []
        with nn_model.trace(ids):
            for i in range(n_layers):
                saved.append(layers[i].self_attn.output[1].save())
            logits = nn_model.output.logits.save()
        return logits, saved
    return run


def _check_patterns(cache: Any, patterns: list, n_layers: int, what: str) -> float:
    return max(check_close(cache[f"blocks.{l}.attn.hook_pattern"], patterns[l], f"{what} layer {l}")
               for l in range(n_layers))


def run(size: Size, ws: Workspace, repeats: int, gqa: bool) -> tuple[list[Row], list[str]]:
    rows = []
    variants = [size] + ([size.with_kv(max(1, size.n_heads // 4))] if gqa else [])
    for sz in variants:
        rows += _one(sz, ws, repeats, full=sz is size)
    return rows, []


def _one(sz: Size, ws: Workspace, repeats: int, full: bool) -> list[Row]:
    rows: list[Row] = []
    base = hf_llama(sz, attn="sdpa")
    eager = with_attn(base, "eager")
    ours = ws.ours(base)
    ids = random_tokens(sz, sz.seq)
    L = sz.n_layers
    label = f"{sz.label()}, T={sz.seq}"
    ours_run = ours_fn(ours, ids)

    # (a) transformers eager, output_attentions=True
    logits, cache = ours_run()
    ref = eager(ids, output_attentions=True)
    d = max(check_close(logits, ref.logits, "logits"), _check_patterns(cache, list(ref.attentions), L, "eager"))
    t = alternate(ours_run, lambda: eager(ids, output_attentions=True), repeats)
    rows.append(Row("2 patterns", f"(a) vs HF eager output_attentions, {label}", seconds(t.a_med), seconds(t.b_med),
                    t.ratio, "≤ 1.0", t.ratio <= 1.0, f"non-causal both; max|Δ| {d:.1e}; {t.spread()}"))

    # (c) nnsight tracing the eager model
    try:
        from nnsight import NNsight
    except ImportError:
        rows.append(Row("2 patterns", f"(c) vs nnsight, {label}", "—", "—", float("nan"), "≤ 1.0", None,
                        "nnsight not installed (pip install -e '.[bench]')"))
    else:
        nn_model = NNsight(eager)
        nn_run = nnsight_fn(nn_model, ids, L)
        n_logits, n_pats = nn_run()
        d = max(check_close(logits, n_logits, "nnsight logits"), _check_patterns(cache, n_pats, L, "nnsight"))
        t = alternate(ours_run, nn_run, repeats)
        rows.append(Row("2 patterns", f"(c) vs nnsight 0.8 trace + save, {label}", seconds(t.a_med),
                        seconds(t.b_med), t.ratio, "≤ 1.0", t.ratio <= 1.0,
                        f"non-causal both (eager); max|Δ| {d:.1e}; {t.spread()}"))
        del nn_model, nn_run

    # (b) TransformerLens TransformerBridge (causal)
    bridge = ws.bridge(base)
    bridge_run = lambda: bridge.run_with_cache(ids, names_filter=is_pattern)  # noqa: E731
    causal = ws.ours(base, causal=True)
    causal_run = ours_fn(causal, ids)
    c_logits, c_cache = causal_run()
    b_logits, b_cache = bridge_run()
    d = max(check_close(c_logits, b_logits, "bridge logits"),
            _check_patterns(c_cache, [b_cache[f"blocks.{l}.attn.hook_pattern"] for l in range(L)], L, "bridge"))
    t = alternate(ours_run, bridge_run, repeats)
    rows.append(Row("2 patterns", f"(b) vs TL TransformerBridge run_with_cache, {label}", seconds(t.a_med),
                    seconds(t.b_med), t.ratio, "≤ 1.0", t.ratio <= 1.0,
                    f"ours bidirectional, bridge causal (not like for like); {t.spread()}"))
    t = alternate(causal_run, bridge_run, repeats)
    rows.append(Row("2 patterns", f"(b') causal HookedMDM vs TL TransformerBridge, {label}", seconds(t.a_med),
                    seconds(t.b_med), t.ratio, "≤ 1.0", t.ratio <= 1.0,
                    f"both causal, like for like; max|Δ| {d:.1e}; {t.spread()}"))
    return rows
