"""Issue #28's measurements: device maps and offloading, on whatever devices this machine has.

    python -m benchmarks.bench_offload                      # all three, 2 GB sharded checkpoint
    python -m benchmarks.bench_offload --only forward,plan --device cuda:0
    python -m benchmarks.bench_offload --rss-gb 0.2         # a quick run

1. forward: offloaded vs resident forward time (ratio; half the blocks on 'disk' on CPU, on 'cpu' and 'disk' with
   an accelerator), after checking the logits agree.
2. rss: peak host RSS (VmHWM, in a fresh subprocess) while loading a sharded checkpoint (written under /tmp and
   deleted afterwards) with every module sent to 'disk' (the loader's own transient: the goal is ≤ 1.1 × one shard
   + the largest tensor's conversion), and resident on the CPU (≈ 1 × the model: no second copy).
3. plan: `model.memory_plan(...)`'s run part vs torch.profiler's peak live tensor bytes of the same generate call,
   and vs the peak RSS above the loaded model; its total vs the peak RSS above the pre-load RSS (subprocess).

Nothing is asserted: the table says what was measured.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from benchmarks.harness import alternate, human_bytes, plain_table

CFG = dict(d_model=512, n_layers=8, n_heads=8, d_mlp=1408, d_vocab=8192, n_ctx=1024, family="mdm_lens",
           mask_token_id=8191, model_name="bench-offload")


def _model(**overrides):
    from mdm_lens import HookedMDM, MDMConfig

    return HookedMDM.from_config(MDMConfig(**{**CFG, **overrides}), seed=0, init_std=0.02)


def bench_forward(device: str, repeats: int) -> list[list[str]]:
    from mdm_lens import HookedMDM
    from mdm_lens.loading import save_pretrained

    root = Path(tempfile.mkdtemp(prefix="mdm_offload_"))
    try:
        folder = save_pretrained(_model(), root / "ckpt")
        resident = HookedMDM.from_pretrained(str(folder), device=device)
        n = resident.cfg.n_layers
        dm = {"embed": device, "ln_final": device, "unembed": device}
        dm.update({f"blocks.{i}": (device if i < n // 2 else ("disk" if i % 2 else "cpu")) for i in range(n)})
        if device == "cpu":
            dm.update({f"blocks.{i}": "disk" for i in range(n // 2, n)})
        off = HookedMDM.from_pretrained(str(folder), device_map=dm, offload_folder=root / "offload")
        tokens = torch.randint(0, 8000, (1, 128), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            err = (resident(tokens) - off(tokens)).abs().max().item()
            t = alternate(lambda: off(tokens), lambda: resident(tokens), repeats)
        where = ", ".join(f"{v}: {sum(1 for x in dm.values() if x == v)}" for v in dict.fromkeys(dm.values()))
        ratio = sorted(t.ratios)[len(t.ratios) // 2]  # the median of the paired per-round ratios
        return [["forward offloaded / resident", f"{ratio:.2f}x", f"{where}; max |Δlogit| {err:.1e}; {t.spread()}"]]
    finally:
        shutil.rmtree(root, ignore_errors=True)


def write_sharded(folder: Path, gb: float) -> tuple[int, int, int]:
    """A native checkpoint of about `gb` GB in ~4 shards, written one shard at a time (never the whole model in
    memory). Returns (total bytes, largest shard bytes, largest tensor bytes)."""
    from mdm_lens import MDMConfig
    from mdm_lens.model import HookedMDM

    d, f, vocab = 1024, 2816, 32000
    per_layer = (4 * d * d + 3 * d * f + 2 * d) * 4
    n_layers = max(1, int((gb * 1e9 - 2 * vocab * d * 4) // per_layer))
    cfg = MDMConfig(d_model=d, n_layers=n_layers, n_heads=16, d_mlp=f, d_vocab=vocab, n_ctx=512, family="mdm_lens",
                    mask_token_id=vocab - 1, model_name="rss-bench")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(cfg.to_json())
    with torch.device("meta"):
        meta = HookedMDM(cfg)
    shapes = {k: tuple(v.shape) for k, v in meta.state_dict().items()}
    groups, current, size = [], [], 0
    target = sum(4 * torch.Size(s).numel() for s in shapes.values()) / 4  # about four shards
    for k, s in shapes.items():
        current.append(k)
        size += 4 * torch.Size(s).numel()
        if size >= target:
            groups.append(current)
            current, size = [], 0
    groups += [current] if current else []
    index, shard_sizes, g = {}, [], torch.Generator().manual_seed(0)
    for i, keys in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {k: (torch.randn(shapes[k], generator=g) * 0.02 + (1.0 if k.endswith(".w") else 0.0)) for k in keys}
        save_file(tensors, str(folder / name))
        shard_sizes.append((folder / name).stat().st_size)
        index.update(dict.fromkeys(keys, name))
        del tensors
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    largest = max(4 * torch.Size(s).numel() for s in shapes.values())
    return sum(shard_sizes), max(shard_sizes), largest


_CHILD = r"""
import json, sys, torch
def status(key):
    for line in open('/proc/self/status'):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
import tempfile
from mdm_lens import HookedMDM
args = json.loads(sys.argv[1])
kw = {'dtype': args['dtype']}
if args['mode'] == 'disk':
    kw.update(device_map={'': 'disk'}, offload_folder=args['offload'])
# warm-up on the tiny zoo model: every lazily imported module (accelerate, tokenizers, ...) is loaded before the
# measure, and the high-water mark is then reset to the current RSS (Linux clear_refs 5)
HookedMDM.from_pretrained('mdm-lens/tiny-mdm', **{**kw, 'offload_folder': tempfile.mkdtemp()} if 'device_map' in kw
                          else kw)
open('/proc/self/clear_refs', 'w').write('5')
base = status('VmRSS:')
m = HookedMDM.from_pretrained(args['folder'], load_tokenizer=False, **kw)
print(json.dumps({'base': base, 'hwm': status('VmHWM:'), 'rss': status('VmRSS:')}))
"""


def _child(code: str, payload: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent), "OMP_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", code, json.dumps(payload)], capture_output=True, text=True, env=env,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_rss(gb: float) -> list[list[str]]:
    root = Path(tempfile.mkdtemp(prefix="mdm_rss_", dir="/tmp"))
    try:
        total, shard, largest = write_sharded(root / "ckpt", gb)
        rows = []
        for mode, dtype in (("disk", "float32"), ("cpu", "float32")):
            r = _child(_CHILD, {"folder": str(root / "ckpt"), "mode": mode, "dtype": dtype,
                                "offload": str(root / f"offload_{dtype}")})
            peak = r["hwm"] - r["base"]
            conversion = largest // 2 if dtype == "bfloat16" else 0
            goal = 1.1 * shard + conversion
            ref = f"goal ≤ {human_bytes(goal)} (1.1 × shard {human_bytes(shard)} + conversion)" if mode == "disk" \
                else f"model {human_bytes(total)}: {peak / total:.2f}x"
            rows.append([f"load peak RSS, {mode}, {dtype}", human_bytes(peak),
                         f"{peak / shard:.2f}x one shard; {ref}; checkpoint {human_bytes(total)}"])
        return rows
    finally:
        shutil.rmtree(root, ignore_errors=True)


_PLAN_CHILD = r"""
import json, sys, torch
def status(key):
    for line in open('/proc/self/status'):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
from mdm_lens import HookedMDM, ReceivedAttention
args = json.loads(sys.argv[1])
HookedMDM.from_pretrained('mdm-lens/tiny-mdm').memory_plan(torch.tensor([[5, 6]]), steps=2, gen_length=2)
open('/proc/self/clear_refs', 'w').write('5')  # imports done; the peak counts from here
base = status('VmRSS:')
m = HookedMDM.from_pretrained(args['folder'], load_tokenizer=False)
prompt = torch.randint(0, 8000, (args['batch'], args['prompt']), generator=torch.Generator().manual_seed(0))
kw = dict(steps=4, gen_length=args['gen'], record=[ReceivedAttention()], kv_cache='dual', block_length=args['gen'])
plan = m.memory_plan(prompt, **kw)
# the plan is of the generate call (weights resident + the run); the loader's own transient peak is measured by
# the rss benchmark, so the peak is reset once the model is loaded
open('/proc/self/clear_refs', 'w').write('5')
loaded = status('VmRSS:')
m.generate(prompt, **kw)
hwm = status('VmHWM:')
# torch.profiler's exact CPU tensor allocations: the peak of live tensor bytes of the same call (the allocator's
# retained free pages and untouched pages, which RSS shows or hides, are not in it)
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
    m.generate(prompt, **kw)
live = peak = 0
for _, n in sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == '[memory]'):
    live += n
    peak = max(peak, live)
r = plan.rows['cpu']
print(json.dumps({'base': base, 'loaded': loaded, 'hwm': hwm, 'plan_total': r.total, 'live_peak': peak,
                  'plan_run': r.total - r.weights, 'weights': r.weights}))
"""


def bench_plan() -> list[list[str]]:
    from mdm_lens.loading import save_pretrained

    root = Path(tempfile.mkdtemp(prefix="mdm_plan_"))
    try:
        folder = save_pretrained(_model(), root / "ckpt")
        rows = []
        for batch, prompt, gen in ((1, 128, 128), (4, 64, 64), (8, 256, 256)):
            r = _child(_PLAN_CHILD, {"folder": str(folder), "batch": batch, "prompt": prompt, "gen": gen})
            measured = r["hwm"] - r["base"]
            run = r["hwm"] - r["loaded"]
            # value: the run part against the profiler's peak live tensor bytes (what the plan models); detail:
            # against the RSS increase above the loaded model, and the total against the RSS increase from import
            rows.append([f"memory plan run part vs profiled peak, batch {batch}, {prompt}+{gen} positions",
                         f"{r['plan_run'] / r['live_peak']:.2f}x",
                         f"plan {human_bytes(r['plan_run'])} vs live tensors {human_bytes(r['live_peak'])}; vs peak "
                         f"RSS above the loaded model {human_bytes(run)}: {r['plan_run'] / run:.2f}x; total plan "
                         f"{human_bytes(r['plan_total'])} vs RSS from before loading {human_bytes(measured)}: "
                         f"{r['plan_total'] / measured:.2f}x (weights {human_bytes(r['weights'])})"])
        return rows
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_offload", description=__doc__.split("\n")[0])
    p.add_argument("--only", default="forward,rss,plan")
    p.add_argument("--device", default="cpu", help="the accelerator of the forward benchmark (default cpu)")
    p.add_argument("--rss-gb", type=float, default=2.0, help="size of the sharded checkpoint (default 2 GB)")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    chosen = {s.strip() for s in args.only.split(",")}
    rows: list[list[str]] = []
    if "forward" in chosen:
        rows += bench_forward(args.device, args.repeats)
    if "rss" in chosen:
        rows += bench_rss(args.rss_gb)
    if "plan" in chosen:
        rows += bench_plan()
    print(plain_table(["measure", "value", "detail"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
