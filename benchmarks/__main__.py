"""`python -m benchmarks` (or `mdm-lens bench`): ratio benchmarks of mdm_lens against transformers,
TransformerLens' TransformerBridge, nnsight and the reference extraction code, all in one process.

    python -m benchmarks                      # the issue's sizes; writes benchmarks/results.md
    python -m benchmarks --only forward,patterns --repeats 5
    python -m benchmarks --size tiny --repeats 1 --out /tmp/r.md    # smoke run (seconds)
    python -m benchmarks --only families,kvcache,ddit --repeats 11    # the opt-in ones (issues #19, #20, #29)

Nothing here asserts anything about wall time: the table says whether each target was met.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

import torch

BENCHES = ("forward", "patterns", "trajectory", "memory")
# run only when named in --only (minutes each at the full size): issue #19's families, issue #20's KV caches
OPTIONAL = ("families", "kvcache", "ddit")
DEFAULT_OUT = Path(__file__).resolve().parent / "results.md"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=["full", "tiny"], default="full", help="model/sequence sizes (default full)")
    p.add_argument("--only", default=",".join(BENCHES),
                   help=f"comma-separated subset of {','.join(BENCHES + OPTIONAL)} (default {','.join(BENCHES)})")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed rounds per comparison (default 31; trajectories 5)")
    p.add_argument("--ref-repeats", type=int, default=None,
                   help="timed rounds against the (slow) reference extractor (default 2)")
    p.add_argument("--no-gqa", action="store_true", help="skip the GQA 8/2 variants of items 1-2")
    p.add_argument("--no-deep", action="store_true", help="skip the 32-layer variant of item 3")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="markdown results file ('-' for none)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    chosen = [b.strip() for b in args.only.split(",") if b.strip()]
    unknown = sorted(set(chosen) - set(BENCHES + OPTIONAL))
    if unknown:
        print(f"unknown benchmark(s) {unknown}; choose from {BENCHES + OPTIONAL}", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:
        pass
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _run(args, chosen, argv)
    finally:
        torch.set_num_threads(previous_threads)  # callers (the smoke test, `mdm-lens bench`) keep theirs


def _run(args: argparse.Namespace, chosen: list[str], argv: list[str] | None) -> int:
    from benchmarks import (bench_ddit, bench_families, bench_forward, bench_kvcache, bench_memory, bench_patterns,
                            bench_trajectory)
    from benchmarks.harness import HEADER, machine_info, markdown_table, plain_table
    from benchmarks.models import SIZES, Workspace

    size = SIZES[args.size]
    reps = args.repeats if args.repeats is not None else 31
    traj_reps = args.repeats if args.repeats is not None else 5
    ref_reps = args.ref_repeats if args.ref_repeats is not None else (1 if args.repeats == 1 else 2)
    info = machine_info()
    rows, sections, timings = [], [], {}
    ws = Workspace()
    try:
        with torch.inference_mode():
            for name in chosen:
                t0 = time.perf_counter()
                print(f"[bench] {name} …", file=sys.stderr, flush=True)
                if name == "forward":
                    r, s = bench_forward.run(size, ws, reps, gqa=not args.no_gqa)
                elif name == "patterns":
                    r, s = bench_patterns.run(size, ws, reps, gqa=not args.no_gqa)
                elif name == "trajectory":
                    r, s = bench_trajectory.run(size, ws, traj_reps, ref_reps, deep=not args.no_deep)
                elif name == "families":
                    r, s = bench_families.run(args.size, reps, traj_reps), [bench_families.size_label(
                        bench_families.SIZES[args.size]) + " (families)"]
                elif name == "kvcache":
                    r, s = bench_kvcache.run(args.size, traj_reps), []
                elif name == "ddit":  # issue #29: MDLM / Duo
                    r, s = bench_ddit.run(args.size, reps, traj_reps), []
                else:
                    r, s = bench_memory.run(size, ws, reps)
                rows += r
                sections += s
                timings[name] = time.perf_counter() - t0
    finally:
        ws.close()

    cells = [r.cells() for r in rows]
    print(plain_table(HEADER, cells))
    for s in sections:
        print("\n" + s)
    if args.out != "-":
        settings = {
            "size": f"{args.size}: {size.label()}, T={size.seq} (forward also {size.seq_long}), batch 1, fp32, "
                    "random weights N(0, 1/d), norm weights 1±0.1",
            "trajectory": f"LLaDA sampler, steps = gen_length = block_length = {size.steps}, greedy, "
                          "low-confidence remasking; prompt = T − gen_length random ids",
            "repeats": f"{reps} paired rounds (trajectories {traj_reps}, vs reference {ref_reps}), one warm-up "
                       "of each side first",
            "threads": str(torch.get_num_threads()),
            "mode": "torch.inference_mode(); ratios = median over rounds of t_ours/t_theirs from A/B/A/B runs",
            "wall time per benchmark": ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()),
        }
        text = ["# mdm_lens benchmark results", "",
                "Generated by `python -m benchmarks " + " ".join(argv if argv is not None else sys.argv[1:]) +
                "`; see `benchmarks/README.md` for what each row measures.", "",
                "## Machine and versions", ""]
        text += [f"- **{k}**: {v}" for k, v in info.items()]
        text += ["", "## Settings", ""] + [f"- **{k}**: {v}" for k, v in settings.items()]
        text += ["", "## Ratios (ours / theirs; speed-ups are theirs / ours)", "", markdown_table(HEADER, cells)]
        for s in sections:
            text += ["", s]
        Path(args.out).write_text("\n".join(text) + "\n")
        print(f"\nwrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
