"""Memory and time of pattern statistics at long contexts: query-chunked rows vs the full pattern.

Workload: one forward of a small bidirectional HookedMDM (random weights) with, on every layer, the two
reductions the sampler reducers use: received attention (mass over all rows, `ColumnSums`) and the
top-4 keys of every query (`RowTopK`), attached with `row_hook`. Variants:

* `full`: `force_explicit=True`, the path the reducers took before (the whole `[batch, head, T, T]`
  scores and softmax, then the reductions) — what any hook on `hook_pattern` still gets;
* `chunk=C`: the chunked path, z built from the same chunks (`row_mode="explicit"`, the default);
* `chunk=C sdpa`: the chunked path with z from SDPA and the rows computed only for the statistics;
* `auto`: the default chunk, from `ROW_CHUNK_BYTES` (32 MiB for one fp32 chunk buffer).

Memory, per T in a fresh subprocess (so no size inherits the heap of another):
* *peak* = the peak of torch's CPU allocator during the call above its level at entry, from the
  allocation events of `torch.profiler(profile_memory=True)` (`total_allocated`: exact, every
  allocation, not sampled), in a separate call from the timed ones;
* *rss peak* = glibc `mallinfo2` in-use bytes sampled every ~1 ms (benchmarks/bench_memory.Peak), a
  cross-check that sees every malloc, not only tensors, but can miss short spikes;
* *predicted* = `hooks.memory.pattern_transient_bytes` (the pattern buffers alone, analytic).

Time: paired rounds in the same process, the variants in rotating order, `gc.collect()` before each
call; the ratio is the median over rounds of `t_variant / t_full`. Nothing here asserts a time.

    python -m benchmarks.bench_chunked                       # T = 512 … 8192, ~5 min on 2 cores
    python -m benchmarks.bench_chunked --seqs 64,96 --chunk 32 --repeats 1 --inline --out -   # smoke
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


def build_model(T: int, n_layers: int = 2, d_model: int = 256, n_heads: int = 4) -> Any:
    from mdm_lens import HookedMDM, MDMConfig

    cfg = MDMConfig(d_model=d_model, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_heads, d_mlp=688,
                    d_vocab=1024, n_ctx=max(T, 64), mask_token_id=1023, attention="bidirectional")
    return HookedMDM.from_config(cfg, seed=0, init_std=0.05)


def variants(chunk: int) -> dict[str, tuple[bool, int | None, str]]:
    """name → (force_explicit, query_chunk, row_mode)."""
    return {"full": (True, None, "explicit"), f"chunk={chunk}": (False, chunk, "explicit"),
            f"chunk={chunk} sdpa": (False, chunk, "sdpa"), "auto": (False, None, "explicit")}


def configure(model: Any, setting: tuple[bool, int | None, str]) -> None:
    from mdm_lens.pattern_rows import set_query_chunk

    explicit, chunk, mode = setting
    set_query_chunk(model, chunk, row_mode=mode)
    for block in model.blocks:
        block.attn.force_explicit = explicit


@torch.inference_mode()
def workload(model: Any, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from mdm_lens.pattern_rows import ColumnSums, RowTopK, row_hook

    rows = torch.ones_like(tokens, dtype=torch.bool)
    layers = range(model.cfg.n_layers)
    sums = {l: ColumnSums(lambda _: rows, kind="mass") for l in layers}
    tops = {l: RowTopK(4) for l in layers}
    hooks = [row_hook(model, l, c) for l in layers for c in (sums[l], tops[l])]
    model.run_with_hooks(tokens, fwd_hooks=hooks, return_type=None)
    return torch.stack([sums[l].result for l in layers]), torch.stack([tops[l].indices for l in layers])


def allocator_peak(fn: Any) -> int:
    """Peak bytes of torch's CPU allocator during `fn()` above the level at its start (profiler events)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events: list[tuple[int, int, int]] = []

    def walk(node: Any) -> None:
        extra = node.extra_fields
        if type(extra).__name__ == "_ExtraFields_Allocation":
            events.append((node.start_time_ns, extra.alloc_size, extra.total_allocated))
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    if not events:
        return 0
    events.sort()
    base = events[0][2] - events[0][1]
    return max(total for _, _, total in events) - base


def measure(T: int, chunk: int, repeats: int, threads: int) -> dict[str, Any]:
    """Everything for one T (run in its own process by `main`)."""
    from benchmarks.bench_memory import Peak
    from mdm_lens.hooks.memory import pattern_transient_bytes

    torch.set_num_threads(threads)
    model = build_model(T)
    tokens = torch.randint(0, 1000, (1, T), generator=torch.Generator().manual_seed(T))
    table = variants(chunk)
    out: dict[str, Any] = {"T": T, "variants": {}}
    results = {}
    for name, setting in table.items():
        configure(model, setting)
        results[name] = workload(model, tokens)  # warm-up, and the values to compare
        gc.collect()
        peak = allocator_peak(lambda: workload(model, tokens))
        gc.collect()
        with Peak() as p:
            workload(model, tokens)
        explicit, size, _ = setting
        rows = None if explicit else (size or _auto_chunk(model, T))
        out["variants"][name] = {"peak": peak, "rss_peak": p.bytes, "chunk": rows,
                                 "predicted": pattern_transient_bytes(model.cfg, 1, T, rows)}
    ref_sums, ref_idx = results["full"]
    for name, (sums, idx) in results.items():
        out["variants"][name]["max_diff"] = float((sums - ref_sums).abs().max())
        out["variants"][name]["topk_equal"] = float((idx == ref_idx).float().mean())
    times: dict[str, list[float]] = {name: [] for name in table}
    names = list(table)
    for r in range(repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            configure(model, table[name])
            gc.collect()
            t0 = time.perf_counter()
            workload(model, tokens)
            times[name].append(time.perf_counter() - t0)
    for name in names:
        ratios = [t / f for t, f in zip(times[name], times["full"])]
        out["variants"][name]["seconds"] = statistics.median(times[name])
        out["variants"][name]["ratio"] = statistics.median(ratios)
    return out


def _auto_chunk(model: Any, T: int) -> int:
    from mdm_lens.pattern_rows import chunk_rows

    return chunk_rows(1, model.cfg.n_heads, T, T)


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def render(rows: list[dict[str, Any]], chunk: int, repeats: int, threads: int) -> str:
    names = list(variants(chunk))
    head = ("| T | variant | chunk rows | peak MiB (allocator) | ÷ smallest T | rss peak MiB (sampled) | "
            "predicted pattern MiB | time s | time ÷ full | max Δ vs full | top-4 idx equal |")
    lines = [head, "|" + "---|" * 11]
    first = {n: rows[0]["variants"][n]["peak"] for n in names}
    for r in rows:
        for n in names:
            v = r["variants"][n]
            lines.append(f"| {r['T']} | {n} | {v['chunk'] or r['T']} | {_mib(v['peak'])} | "
                         f"{v['peak'] / max(first[n], 1):.1f}× | {_mib(v['rss_peak'])} | {_mib(v['predicted'])} | "
                         f"{v['seconds']:.3f} | {v['ratio']:.3f} | {v['max_diff']:.1e} | {v['topk_equal']:.4f} |")
    cfg = build_model(64).cfg
    note = (f"{cfg.n_layers} layers, d_model {cfg.d_model}, {cfg.n_heads} heads, d_mlp {cfg.d_mlp}, fp32, batch 1, "
            f"bidirectional, no padding; {repeats} paired rounds, {threads} threads, torch {torch.__version__}.")
    return note + "\n\n" + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="512,1024,2048,4096,8192")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--inline", action="store_true", help="measure in this process (smoke tests)")
    ap.add_argument("--out", default="-", help="a markdown file, or - for stdout")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.child, args.chunk, args.repeats, args.threads)))
        return ""
    rows = []
    for T in (int(x) for x in args.seqs.split(",")):
        if args.inline:
            rows.append(measure(T, args.chunk, args.repeats, args.threads))
            continue
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        cmd = [sys.executable, "-m", "benchmarks.bench_chunked", "--child", str(T), "--chunk", str(args.chunk),
               "--repeats", str(args.repeats), "--threads", str(args.threads)]
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"T={T} done", file=sys.stderr, flush=True)
    text = render(rows, args.chunk, args.repeats, args.threads)
    if args.out == "-":
        print(text)
    else:
        Path(args.out).write_text(text)
    return text


if __name__ == "__main__":
    main()
