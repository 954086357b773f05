"""nnsight tracing of a denoising trajectory (`mdm_lens.nnsight.DiffusionLM`) vs the same observation
with mdm_lens' own step hooks: a 32-step LLaDA run saving one layer's attention pattern at 4 steps.

    python -m benchmarks.bench_nnsight                    # full (8L d512, T 256) and small sizes, 7 rounds
    python -m benchmarks.bench_nnsight --size tiny --repeats 1     # smoke

Both sides run the same sampler on the same random-weight HookedMDM; before timing, the saved patterns
and the final tokens are checked identical. The ratio is nnsight / step hooks (median of paired
rounds, see `benchmarks.harness`); target ≤ 1.2.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import Any

import torch

from benchmarks.harness import HEADER, Row, alternate, machine_info, markdown_table, seconds

SIZES = {  # name: (n_layers, d_model, n_heads, d_mlp, vocab, prompt length, steps)
    "full": (8, 512, 8, 1376, 4096, 224, 32),  # the trajectory benchmark's model and T = 256
    "small": (4, 64, 4, 128, 256, 32, 32),  # a tiny model: per-module overhead is all there is
    "tiny": (2, 32, 4, 48, 64, 8, 8),
}
LAYER = 1
TARGET = 1.2


def _model(size: str) -> tuple[Any, torch.Tensor, int]:
    from mdm_lens import HookedMDM, MDMConfig

    n_layers, d_model, heads, d_mlp, vocab, prompt_len, n_steps = SIZES[size]
    cfg = MDMConfig(d_model=d_model, n_layers=n_layers, n_heads=heads, n_kv_heads=heads, d_mlp=d_mlp,
                    d_vocab=vocab, mask_token_id=vocab - 1, n_ctx=prompt_len + n_steps, eos_token_id=1)
    model = HookedMDM.from_config(cfg, seed=0, init_std=d_model ** -0.5)
    prompt = torch.randint(2, vocab - 1, (1, prompt_len), generator=torch.Generator().manual_seed(2))
    return model, prompt, n_steps


def runs(size: str) -> tuple[Any, Any, list[int], int]:
    """The nnsight run and the step-hook run of one size (each returns the 4 patterns and the output)."""
    from mdm_lens import steps
    from mdm_lens.nnsight import DiffusionLM

    model, prompt, n_steps = _model(size)
    lm = DiffusionLM(model)
    chosen = sorted({0, n_steps // 3, 2 * n_steps // 3, n_steps - 1})
    kw = dict(steps=n_steps, gen_length=n_steps, block_length=n_steps, progress=False)
    name = f"blocks.{LAYER}.attn.hook_pattern"

    def traced():
        pats: list = []
        with lm.generate(prompt, **kw) as tracer:
            for _ in tracer.iter[chosen]:
                pats.append(lm.blocks[LAYER].attn.hook_pattern.output.save())
            out = tracer.result.save()
        return pats, out

    def hooked():
        out = model.generate(prompt, cache=name @ steps(*chosen), **kw)
        return [out.cache[s][name] for s in chosen], out

    return traced, hooked, chosen, prompt.shape[1] + n_steps


def check(traced: Any, hooked: Any) -> str:
    (pa, oa), (pb, ob) = traced(), hooked()
    if not (len(pa) == len(pb) and all(torch.equal(a, b) for a, b in zip(pa, pb))):
        raise AssertionError("nnsight and the step hooks saved different patterns")
    if not torch.equal(oa.tokens, ob.tokens):
        raise AssertionError("nnsight and the step hooks generated different tokens")
    return "patterns and tokens identical"


def bench(size: str, repeats: int) -> Row:
    traced, hooked, chosen, total = runs(size)
    note = check(traced, hooked)  # also the warm-up of both sides
    t = alternate(traced, hooked, repeats, warmup=0)
    n_layers, d_model = SIZES[size][:2]
    case = f"{size}: {n_layers}L d{d_model}, T {total}, {SIZES[size][-1]} steps, pattern of layer {LAYER} at {chosen}"
    return Row("nnsight", case, seconds(t.a_med), seconds(t.b_med), t.ratio, f"≤ {TARGET}", t.ratio <= TARGET,
               f"{note}; {t.spread()}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_nnsight", description=__doc__.split("\n")[0])
    p.add_argument("--size", default="full,small", help=f"comma-separated subset of {','.join(SIZES)}")
    p.add_argument("--repeats", type=int, default=7, help="paired timed rounds (default 7)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    sizes = [s.strip() for s in args.size.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        print(f"unknown size(s) {unknown}; choose from {list(SIZES)}", file=sys.stderr)
        return 2
    previous = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        with warnings.catch_warnings(), torch.inference_mode():
            warnings.simplefilter("ignore")
            rows = [bench(s, args.repeats) for s in sizes]
    finally:
        torch.set_num_threads(previous)
    info = machine_info()
    print(markdown_table(HEADER, [r.cells() for r in rows]))
    print("\n" + ", ".join(f"{k}: {info[k]}" for k in ("date (UTC)", "torch", "nnsight", "load average at start")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
