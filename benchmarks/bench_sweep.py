"""Sweep throughput: `mdm_lens.sweep.run` (batched) vs the same probes called item by item, and the 2-rank
torchrun speed-up on this machine.

    python -m benchmarks.bench_sweep                 # 64 zoo items on tiny-mdm, 3 paired rounds
    python -m benchmarks.bench_sweep --n 16 --rounds 1 --no-ranks     # smoke run

(1) items/s, paired rounds in one process, one thread each: the sweep (accuracy, absorption, temporal, qk,
flow; batch 16; `--batching length` and `padded`) against a loop that calls, per item, the public probe
functions a user would call without the sweep: `model.generate` (with `ReceivedAttention`),
`absorption_by_layer` (default and paper), `anchors_over_steps` + `drift_from_output` and `qk_at_layer` at every
layer, `flow_for_items`, and the closed-book generation, each answer scored (substring / EM / F1) as the
sweep's accuracy rows are. The sweep's time includes what the loop does not do: building its tables, writing
and merging its Parquet files, the summaries and the manifest. The sweep shares work the loop repeats (one
sampler run serves accuracy, temporal, absorption, qk and flow, where `flow_for_items` generates again; one
clean forward serves absorption in both modes and flow; one serves qk at every layer); every row still
equals the probe called alone (bit for bit with `--batching length`, tests/test_sweep_exact.py).
(2) wall time of `python -m mdm_lens.sweep` (1 process, 1 and 2 threads) vs `torchrun --nproc-per-node 2`
(1 thread per rank), process start-up included, and the ranks' own compute time from manifest.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
PROBES = "accuracy,absorption,temporal,qk,flow"


def item_by_item(model, items) -> None:
    from mdm_lens import ReceivedAttention
    from mdm_lens.probes import retrieval
    from mdm_lens.probes import run as R
    from mdm_lens.zoo import data as D
    from mdm_lens.zoo import tokenizer as ZT

    g = int(model.cfg.extra.get("gen_length", 4))
    for it in items:
        ids = torch.tensor(ZT.encode(it.prompt))
        out = model.generate(ids, steps=g, gen_length=g, record=[ReceivedAttention()], progress=False)
        toks, am = out.tokens, out.attention_mask
        nb = ids.new_tensor(ZT.encode(f"{D.BOS} {D.QUESTION_CUE} {it.question} {D.ANSWER_PREFIX}"))
        closed = model.generate(nb, steps=g, gen_length=g, progress=False)
        for run, n in ((out, len(ids)), (closed, len(nb))):                # score both answers, as the sweep does
            gen = run.tokens[0, n:].tolist()
            pred = ZT.decode(gen)
            retrieval.answer_correct(model, gen, it.answer), D.exact_match(pred, it.answer), D.token_f1(pred, it.answer)
        for mode in ("default", "paper"):
            R.absorption_by_layer(model, toks, attention_mask=am, mode=mode)
        for layer in range(model.cfg.n_layers):
            R.anchors_over_steps(out, layer=layer)
            R.drift_from_output(out, layer=layer)
            R.qk_at_layer(model, toks, layer, attention_mask=am)
        R.flow_for_items(model, [it])


def throughput(n: int, rounds: int) -> list[str]:
    from mdm_lens import HookedMDM, sweep
    from mdm_lens.zoo import jsonl

    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="bench_sweep_"))
    data = work / "items.jsonl"
    items = jsonl.export(data, n, seed=2024)
    model = HookedMDM.from_pretrained("mdm-lens/tiny-mdm")
    sweep.run(model, data, PROBES, work / "warm", limit=4, progress=False)   # warm-up
    t = {"loop": [], "length": [], "padded": []}
    for r in range(rounds):
        t0 = time.perf_counter()
        item_by_item(model, items)
        t["loop"].append(time.perf_counter() - t0)
        for mode in ("length", "padded"):
            t0 = time.perf_counter()
            sweep.run(model, data, PROBES, work / f"{mode}{r}", batch_size=16, batching=mode, progress=False)
            t[mode].append(time.perf_counter() - t0)
    shutil.rmtree(work, ignore_errors=True)
    lines = [f"(1) {n} items, probes {PROBES}, tiny-mdm, 1 thread, median of {rounds} paired round(s)", "",
             "| run | s | items/s | speed-up vs item by item |", "|---|---|---|---|"]
    loop = statistics.median(t["loop"])
    for k, label in (("loop", "probes item by item"), ("length", "sweep, batch 16, --batching length"),
                     ("padded", "sweep, batch 16, --batching padded")):
        m = statistics.median(t[k])
        ratios = [a / b for a, b in zip(t["loop"], t[k])]
        lines.append(f"| {label} | {m:.2f} | {n / m:.1f} | {statistics.median(ratios):.2f}× |")
    return lines


def _cli(out: Path, data: Path, threads: int, ranks: int) -> tuple[float, list]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(threads))
    args = ["--model", "mdm-lens/tiny-mdm", "--data", str(data), "--probes", PROBES, "--batch-size", "8",
            "--no-progress", "--out", str(out)]
    launch = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
              if ranks > 1 else [sys.executable])
    t0 = time.perf_counter()
    subprocess.run([*launch, "-m", "mdm_lens.sweep", *args], cwd=ROOT, env=env, check=True, capture_output=True)
    wall = time.perf_counter() - t0
    return wall, json.loads((out / "manifest.json").read_text())["ranks"]


def ranks(n: int) -> list[str]:
    from mdm_lens.zoo import jsonl

    work = Path(tempfile.mkdtemp(prefix="bench_sweep_ranks_"))
    data = work / "items.jsonl"
    jsonl.export(data, n, seed=2024)
    lines = [f"(2) {n} items, `python -m mdm_lens.sweep` wall time incl. start-up; compute = the ranks' "
             "own batch time (max over ranks)", "", "| launch | wall s | compute s | speed-up (wall) |",
             "|---|---|---|---|"]
    base = None
    for label, threads, nr in (("1 process, 1 thread", 1, 1), ("1 process, 2 threads", 2, 1),
                               ("torchrun 2 ranks x 1 thread (gloo)", 1, 2)):
        wall, info = _cli(work / label.replace(" ", "_"), data, threads, nr)
        base = base or wall
        comp = max(r["compute_s"] for r in info)
        lines.append(f"| {label} | {wall:.1f} | {comp:.1f} | {base / wall:.2f}× |")
    shutil.rmtree(work, ignore_errors=True)
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_sweep", description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-ranks", action="store_true")
    p.add_argument("--ranks-n", type=int, default=None,
                   help="items for the rank runs (default --n); start-up dominates small runs")
    p.add_argument("--only-ranks", action="store_true")
    a = p.parse_args(argv)
    out = [] if a.only_ranks else throughput(a.n, a.rounds)
    if not a.no_ranks:
        out += [""] + ranks(a.ranks_n or a.n)
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
