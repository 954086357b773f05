"""Step-wise activation export and SAE splicing, as ratios in one process.

    python -m benchmarks.bench_export                  # the "full" bench model (8L d512), 5 paired rounds
    python -m benchmarks.bench_export --size tiny --rounds 1 --items 4 --n-steps 4      # smoke run

Defaults: 8 prompts of 32 random tokens, batch 4, 16 steps, gen_length 32 (two commits a step), the hook
`blocks.{n_layers // 2}.hook_resid_post`, exported steps `steps(every=4)` (0, 4, 8, 12 and the last).

(1) `mdm_lens.sae.export_activations(model, ids, hook, steps=steps(every=4), positions=..., out=DIR)` against
the `generate` calls it makes, run plainly with the same `TrajectoryCache` (same hook, same steps, same
batch composition: `make_batches(..., "length")`, one call per equal-length group, same seeds) and nothing
written. The export's time also includes its argument checks (one short forward to size the hooks),
selecting the rows, building the Arrow shards, `save_to_disk` per batch, the `.done` markers, the
consolidation into one `load_from_disk` folder, the manifest and `load_from_disk` of the result.
Target ≤ 1.2×.
(2) `generate(..., fwd_hooks=[sae_hook(sae, hook)])` (the SAE spliced at every step) against the same
`generate` without hooks; the ratio of totals is the per-step ratio (same steps), and the note gives the
added time per step. The SAE is a standard one with d_sae = 8 · d_model: sae-lens' `StandardSAE` when
sae-lens is installed, else a plain torch module with its surface (`encode`, `decode`, `W_dec`, `hooks()`,
`use_error_term`, the same relu encoder).
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.harness import Timing, seconds


def alternate(a, b, repeats: int, warmup: int = 1) -> tuple[Timing, Timing]:
    """The harness' paired A/B rounds, timing each call in wall seconds and in this process' CPU seconds
    (`time.process_time`): on a shared VM the CPU time is far less disturbed by other jobs than the wall."""
    import gc
    import time

    for _ in range(warmup):
        a()
        b()
    wall: tuple[list, list] = ([], [])
    cpu: tuple[list, list] = ([], [])
    for _ in range(max(1, repeats)):
        for side, fn in enumerate((a, b)):
            gc.collect()
            w, c = time.perf_counter(), time.process_time()
            fn()
            wall[side].append(time.perf_counter() - w)
            cpu[side].append(time.process_time() - c)
    return tuple(Timing(x, y, [p / q for p, q in zip(x, y)]) for x, y in (wall, cpu))
from benchmarks.models import MASK_OFFSET, SIZES, Workspace, hf_llama


class PlainSAE(torch.nn.Module):
    """SAELens' standard SAE surface without sae-lens: relu((x - b_dec) W_enc + b_enc) W_dec + b_dec."""

    def __init__(self, d_in: int, d_sae: int, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.W_enc = torch.nn.Parameter(torch.randn(d_in, d_sae, generator=g) / d_in ** 0.5)
        self.W_dec = torch.nn.Parameter(self.W_enc.detach().T.clone())
        self.b_enc = torch.nn.Parameter(torch.zeros(d_sae))
        self.b_dec = torch.nn.Parameter(torch.zeros(d_in))
        self.use_error_term = False
        self.hook_dict: dict = {}

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu((x - self.b_dec) @ self.W_enc + self.b_enc)

    def decode(self, a: torch.Tensor) -> torch.Tensor:
        return a @ self.W_dec + self.b_dec

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.decode(self.encode(x))
        return out + (x - out).detach() if self.use_error_term else out

    @contextlib.contextmanager
    def hooks(self, fwd_hooks=()):
        if fwd_hooks:
            raise ValueError("PlainSAE has no hook points")
        yield self


def make_sae(d_in: int) -> tuple[torch.nn.Module, str]:
    try:
        from sae_lens import StandardSAE, StandardSAEConfig
    except ImportError:
        return PlainSAE(d_in, 8 * d_in), "plain torch SAE (sae-lens absent)"
    torch.manual_seed(0)
    return StandardSAE(StandardSAEConfig(d_in=d_in, d_sae=8 * d_in)), "sae_lens.StandardSAE"


def prompts(vocab: int, n: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return torch.randint(2, vocab - MASK_OFFSET, (n, length), generator=g).tolist()


def export_vs_generate(model, data, hook, gen, batch_size, positions, rounds, work: Path) -> tuple[str, float]:
    from mdm_lens import TrajectoryCache, steps
    from mdm_lens.sae import export_activations
    from mdm_lens.sweep.runner import item_seed, make_batches

    when = steps(every=4)
    batches = make_batches([len(p) for p in data], batch_size, "length")
    count = [0]

    def ours():
        count[0] += 1
        out = work / f"{positions}{count[0]}"
        export_activations(model, data, hook, out=out, steps=when, positions=positions, batch_size=batch_size,
                           progress=False, **gen)
        shutil.rmtree(out)

    def theirs():
        for b in batches:
            for length in dict.fromkeys(len(data[i]) for i in b):
                g = [i for i in b if len(data[i]) == length]
                model.generate(torch.tensor([data[i] for i in g]), steps=gen["n_steps"], gen_length=gen["gen_length"],
                               seed=item_seed(0, str(g[0])), cache=TrajectoryCache(hook, when), progress=False)

    t, c = alternate(ours, theirs, rounds)
    return (f"| export, positions={positions} vs generate + same cache | {seconds(t.a_med)} | {seconds(t.b_med)} | "
            f"**{t.ratio:.3f}** | **{c.ratio:.3f}** | wall: {t.spread()}; CPU: {c.spread()} |"), c.ratio


def splice_vs_plain(model, data, hook, gen, rounds) -> tuple[str, float]:
    from mdm_lens.sae import sae_hook

    sae, kind = make_sae(model.cfg.d_model)
    ids = torch.tensor(data)
    n = gen["n_steps"]
    kw = dict(steps=n, gen_length=gen["gen_length"], progress=False)
    h = sae_hook(sae, hook)
    t, c = alternate(lambda: model.generate(ids, fwd_hooks=[h], **kw), lambda: model.generate(ids, **kw), rounds)
    per_step = (c.a_med - c.b_med) / n
    return (f"| SAE splice at every step ({kind}, d_sae {8 * model.cfg.d_model}) vs no hook | {seconds(t.a_med)} | "
            f"{seconds(t.b_med)} | **{t.ratio:.3f}** | **{c.ratio:.3f}** | wall: {t.spread()}; CPU: {c.spread()}; "
            f"{per_step * 1e3:+.2f} ms CPU per step |"), c.ratio


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_export", description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="full")
    p.add_argument("--items", type=int, default=8)
    p.add_argument("--prompt-length", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--n-steps", type=int, default=16, help="denoising steps; gen_length is twice this")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    size = SIZES[a.size]
    ws = Workspace()
    work = Path(tempfile.mkdtemp(prefix="bench_export_"))
    try:
        model = ws.ours(hf_llama(size))
        g = a.n_steps
        gen = dict(n_steps=g, gen_length=2 * g)  # 2 tokens per step
        hook = f"blocks.{size.n_layers // 2}.hook_resid_post"
        data = prompts(size.vocab, a.items, a.prompt_length)
        print(f"model {size.label()}, {a.items} prompts of {a.prompt_length} tokens, batch {a.batch_size}, "
              f"gen_length {gen['gen_length']}, {g} steps, hook {hook}, exported steps every=4 (+ last), "
              f"{a.threads} threads, median of {a.rounds} paired rounds\n")
        print("| case | ours (wall) | theirs (wall) | ratio wall | ratio CPU | note |\n|---|---|---|---|---|---|")
        for positions in ("masked", "all"):
            print(export_vs_generate(model, data, hook, gen, a.batch_size, positions, a.rounds, work)[0])
        print(splice_vs_plain(model, data[:a.batch_size], hook, gen, a.rounds)[0])
    finally:
        shutil.rmtree(work, ignore_errors=True)
        ws.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
