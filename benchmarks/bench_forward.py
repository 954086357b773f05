"""Item 1: a forward pass without hooks, HookedMDM vs transformers `LlamaForCausalLM` (non-causal, sdpa)."""

from __future__ import annotations

import torch

from benchmarks.harness import Row, alternate, seconds
from benchmarks.models import Size, Workspace, hf_llama, random_tokens

TOL = 1e-4


def check_close(a: torch.Tensor, b: torch.Tensor, what: str, tol: float = TOL) -> float:
    diff = float((a.float() - b.float()).abs().max())
    if not diff <= tol:
        raise AssertionError(f"{what}: implementations disagree (max |Δ| = {diff:.3g} > {tol}); not timing it")
    return diff


def run(size: Size, ws: Workspace, repeats: int, gqa: bool) -> tuple[list[Row], list[str]]:
    rows = []
    variants = [size] + ([size.with_kv(max(1, size.n_heads // 4))] if gqa else [])
    for sz in variants:
        ref = hf_llama(sz, attn="sdpa")
        ours = ws.ours(ref)
        seqs = [sz.seq] + ([sz.seq_long] if sz is size else [])
        for t in seqs:
            ids = random_tokens(sz, t)
            diff = check_close(ours(ids), ref(ids).logits, f"forward T={t}")
            timing = alternate(lambda: ours(ids), lambda: ref(ids), repeats)
            rows.append(Row("1 forward", f"no hooks, {sz.label()}, T={t}", seconds(timing.a_med),
                            seconds(timing.b_med), timing.ratio, "≤ 1.05", timing.ratio <= 1.05,
                            f"vs HF sdpa is_causal=False; max|Δlogit| {diff:.1e}; {timing.spread()}"))
        del ref, ours
    return rows, []
