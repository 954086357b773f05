"""Where the time goes: `python -m benchmarks.profiling [forward|patterns|trajectory] [--ab] [--gqa]`.

Prints torch.profiler op tables for ours and the comparison side, and (for patterns/trajectory) an
A/B timing of the current `Attention._explicit` against the previous one (`previous_explicit`,
monkeypatched in for the B side), so each change to the explicit path is measured in one process.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import replace

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.harness import alternate, seconds
from benchmarks.models import SIZES, Workspace, hf_llama, random_tokens, with_attn


def previous_explicit(self, q, k, v, mask, is_causal):
    """`Attention._explicit` before the 2026-12-02 profiling (kept to A/B against the current one):
    K/V repeated per query head, scores divided by √d (a T² pass), `nan_to_num` over every pattern
    (another T² pass) even when no mask can empty a row."""
    if self.repeat_kv_heads > 1:
        k = k.repeat_interleave(self.repeat_kv_heads, dim=1)
        v = v.repeat_interleave(self.repeat_kv_heads, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.d_head)
    if is_causal and mask is None:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    scores = self.hook_attn_scores(scores)
    pattern = torch.softmax(scores, dim=-1, dtype=torch.float32)
    pattern = torch.nan_to_num(pattern, nan=0.0).to(q.dtype)
    pattern = self.hook_pattern(pattern)
    return torch.matmul(pattern, v)


def _table(name: str, fn, n: int = 5) -> None:
    fn()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            fn()
    print(f"\n=== {name} ({n} calls) ===")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.profiling")
    p.add_argument("what", choices=["forward", "patterns", "trajectory"], nargs="?", default="patterns")
    p.add_argument("--size", choices=list(SIZES), default="full")
    p.add_argument("--ab", action="store_true", help="also A/B the current _explicit against previous_explicit")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--gqa", type=int, default=0, help="number of kv heads (0 = the size's MHA)")
    p.add_argument("--seq", type=int, default=0, help="sequence length T (0 = the size's default)")
    p.add_argument("--no-tables", action="store_true", help="skip the profiler tables, only time")
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    from mdm_lens import ReceivedAttention
    from mdm_lens.components import Attention

    sz = SIZES[args.size]
    if args.gqa:
        sz = sz.with_kv(args.gqa)
    if args.seq:
        sz = replace(sz, seq=args.seq)
    ws = Workspace()
    try:
        with torch.inference_mode():
            base = hf_llama(sz)
            ours = ws.ours(base)
            ids = random_tokens(sz, sz.seq)
            if args.what == "forward":
                ours_fn, theirs_fn = (lambda: ours(ids)), (lambda: base(ids))
            elif args.what == "patterns":
                eager = with_attn(base, "eager")
                ours_fn = lambda: ours.run_with_cache(ids, names_filter=lambda n: n.endswith("hook_pattern"))  # noqa
                theirs_fn = lambda: eager(ids, output_attentions=True)  # noqa: E731
            else:
                prompt = random_tokens(sz, sz.seq - sz.steps, seed=2)
                kw = dict(steps=sz.steps, gen_length=sz.steps, block_length=sz.steps, progress=False)
                ours_fn = lambda: ours.generate(prompt, record=[ReceivedAttention()], **kw)  # noqa: E731
                theirs_fn = lambda: ours.generate(prompt, **kw)  # noqa: E731
            if not args.no_tables:
                _table("ours", ours_fn, 2 if args.what == "trajectory" else 5)
                _table("theirs", theirs_fn, 2 if args.what == "trajectory" else 5)
            reps = args.repeats if args.what != "trajectory" else max(1, args.repeats // 3)
            if args.ab and args.what != "forward":
                current = Attention._explicit
                previous = lambda: (setattr(Attention, "_explicit", previous_explicit), ours_fn(),  # noqa: E731
                                    setattr(Attention, "_explicit", current))
                t = alternate(ours_fn, previous, reps)
                print(f"\ncurrent {seconds(t.a_med)}  previous {seconds(t.b_med)}  current/previous "
                      f"{t.ratio:.3f} ({t.spread()})")
            t = alternate(ours_fn, theirs_fn, reps)
            print(f"ours {seconds(t.a_med)}  theirs {seconds(t.b_med)}  ours/theirs {t.ratio:.3f} ({t.spread()})")
    finally:
        ws.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
