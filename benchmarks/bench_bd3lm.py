"""BD3LM's KV cache: the semi-AR block sampler with `kv_cache=True` against the same run recomputing the window
every forward (`kv_cache=False`), on random realistic weights in one process (paired, alternating rounds;
`benchmarks.harness`). Tokens are checked identical before timing (without time conditioning, the released
setting, the cached keys are the recomputed ones). The ratio is a speed-up; nothing is asserted about wall time.

    python -m benchmarks.bench_bd3lm                 # d_model 256, 4 layers, 256 tokens, blocks of 16
    python -m benchmarks.bench_bd3lm --size tiny     # a smoke run
"""

from __future__ import annotations

import argparse
import warnings

import torch

from benchmarks.harness import HEADER, Row, alternate, markdown_table, seconds
from mdm_lens.ddit.bd3lm import HookedBD3LM
from mdm_lens.ddit.config import ddit_config

SIZES = {"full": dict(d_model=256, n_layers=4, n_heads=8, vocab=512, n=256, block=16, steps=32),
         "tiny": dict(d_model=32, n_layers=2, n_heads=4, vocab=64, n=32, block=4, steps=8)}


def build(size: str) -> tuple[HookedBD3LM, dict]:
    s = SIZES[size]
    cfg = ddit_config("bd3lm", d_vocab=s["vocab"], n_ctx=s["n"], d_model=s["d_model"], cond_dim=64,
                      n_layers=s["n_layers"], n_heads=s["n_heads"], time_conditioning=False, block_size=s["block"])
    cfg.mask_token_id, cfg.extra["parameterization"] = s["vocab"] - 1, "subs"
    return HookedBD3LM.from_config(cfg, seed=0, init_std=0.05), s


def rows(size: str = "full", repeats: int = 5) -> list[Row]:
    model, s = build(size)
    prompt = torch.tensor([[1]])
    out = []
    for label, kw in (("first hitting", dict(first_hitting=True)),
                      ("linspace steps, nucleus 0.9", dict(first_hitting=False, nucleus_p=0.9))):
        base = dict(gen_length=s["n"] - 1, steps=s["steps"], progress=False, seed=0, **kw)
        cached = lambda kw=base: model.generate(prompt, kv_cache=True, **kw)  # noqa: E731
        plain = lambda kw=base: model.generate(prompt, kv_cache=False, **kw)  # noqa: E731
        a, b = cached(), plain()
        if not torch.equal(a.tokens, b.tokens):
            raise AssertionError(f"{label}: the cached and recomputing samplers decode differently")
        t = alternate(cached, plain, repeats)
        out.append(Row("B bd3lm", f"kv_cache vs recompute, {label}", seconds(t.a_med), seconds(t.b_med), 1 / t.ratio,
                       "(report)", None, f"{s['n']} tokens, blocks of {s['block']}, tokens equal; {t.spread()}",
                       speedup=True))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_bd3lm", description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=list(SIZES), default="full")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    with warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("ignore")
        table = rows(a.size, a.repeats)
    print(markdown_table(HEADER, [r.cells() for r in table]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
