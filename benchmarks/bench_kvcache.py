"""Fast-dLLM's approximate KV caches on LLaDA: our `kv_cache="prefix"` / `"dual"` samplers against the same
algorithm in the reference's own form on the same weights (`benchmarks.reference_fastdllm`: a transcription of
Fast-dLLM's `generate_with_prefix_cache` / `generate_with_dual_cache` driving a plain-torch LLaDA with
`past_key_values` / `replace_position`; tokens checked identical before timing; target ≤ 1.05), their speed-up over
the uncached Fast-dLLM loop, and the cost of recording `ReceivedAttention()` on a cached trajectory, in one process
(paired, alternating rounds; `benchmarks.harness`).

    python -m benchmarks.bench_kvcache                 # d_model 256, 4 layers, prompt 64, 256 tokens, blocks of 32
    python -m benchmarks.bench_kvcache --size tiny     # a smoke run

The uncached baseline is the same Fast-dLLM loop (`threshold=` / the block schedule) without a cache, so the
ratio isolates the cache. Nothing is asserted about wall time.
"""

from __future__ import annotations

import argparse
import warnings

import torch

from benchmarks.harness import HEADER, Row, alternate, markdown_table, seconds
from benchmarks.reference_fastdllm import PlainLLaDA, generate_with_dual_cache, generate_with_prefix_cache
from mdm_lens import HookedMDM, MDMConfig, ReceivedAttention

SIZES = {"full": dict(d_model=256, n_layers=4, n_heads=8, d_mlp=688, vocab=512, prompt=64, gen=256, block=32),
         "tiny": dict(d_model=32, n_layers=2, n_heads=4, d_mlp=64, vocab=64, prompt=8, gen=16, block=8)}


def build(size: str) -> tuple[HookedMDM, torch.Tensor, dict]:
    s = SIZES[size]
    mask = s["vocab"] - 1
    cfg = MDMConfig(d_model=s["d_model"], n_layers=s["n_layers"], n_heads=s["n_heads"], d_mlp=s["d_mlp"],
                    d_vocab=s["vocab"], mask_token_id=mask, n_ctx=s["prompt"] + s["gen"])
    model = HookedMDM.from_config(cfg, seed=0, init_std=0.05)
    prompt = torch.randint(0, mask, (1, s["prompt"]), generator=torch.Generator().manual_seed(0))
    return model, prompt, s


def rows(size: str = "full", repeats: int = 5) -> list[Row]:
    model, prompt, s = build(size)
    base = dict(gen_length=s["gen"], block_length=s["block"], steps=s["gen"], progress=False)
    out = []
    for label, extra in (("block schedule, 1 token/step", {}), ("threshold 0.9", dict(threshold=0.9))):
        # threshold decides its number of forwards itself: an explicit steps is refused there
        base_x = {k: v for k, v in base.items() if k != "steps"} if extra else base
        uncached = dict(base_x, **extra) if extra else dict(base, threshold=None)
        # the uncached Fast-dLLM loop needs a rule: the schedule row compares against LLaDA's own loop
        plain = lambda kw=uncached: model.generate(prompt, **kw)  # noqa: E731
        for mode in ("prefix", "dual"):
            cached = lambda kw=dict(base_x, **extra, kv_cache=mode): model.generate(prompt, **kw)  # noqa: E731
            t = alternate(cached, plain, repeats)
            n = model.generate(prompt, **dict(base_x, **extra, kv_cache=mode)).trajectory.n_steps
            out.append(Row("K kv cache", f"{mode} cache vs none, {label}", seconds(t.a_med), seconds(t.b_med),
                           1 / t.ratio, "(report)", None, f"{n} forwards; {t.spread()} (of cached/none)", speedup=True))
    dual = dict(base, kv_cache="dual")
    t = alternate(lambda: model.generate(prompt, record=[ReceivedAttention()], **dual),
                  lambda: model.generate(prompt, **dual), repeats)
    out.append(Row("K kv cache", "ReceivedAttention() on a dual-cache run vs none, block schedule",
                   seconds(t.a_med), seconds(t.b_med), t.ratio, "≤ 1.3", t.ratio <= 1.3, t.spread()))
    return out


def reference_rows(size: str = "full", repeats: int = 5) -> list[Row]:
    """Ours vs the reference form of the same cached decoding, no hooks; token-exactness asserted first."""
    model, prompt, s = build(size)
    ref = PlainLLaDA({k: v.detach() for k, v in model.state_dict().items()}, model.cfg)
    mask = model.cfg.mask_token_id
    out = []
    for mode, fn in (("prefix", generate_with_prefix_cache), ("dual", generate_with_dual_cache)):
        for label, thr in (("block schedule, 1 token/step", None), ("threshold 0.9", 0.9)):
            kw = dict(gen_length=s["gen"], block_length=s["block"], steps=s["gen"], kv_cache=mode, threshold=thr,
                      progress=False)
            ours = lambda kw=kw: model.generate(prompt, **kw)  # noqa: E731
            theirs = lambda fn=fn, thr=thr: fn(ref, prompt, s["gen"], s["gen"], s["block"], mask, thr)  # noqa: E731
            mine, (x, nfe) = ours(), theirs()
            if not torch.equal(mine.tokens, x) or mine.trajectory.n_steps != nfe:
                raise AssertionError(f"{mode}/{label}: ours and the reference form decode differently")
            t = alternate(ours, theirs, repeats)
            out.append(Row("K kv cache", f"{mode} cache vs Fast-dLLM reference form, {label}", seconds(t.a_med),
                           seconds(t.b_med), t.ratio, "≤ 1.05", t.ratio <= 1.05,
                           f"{nfe} forwards, tokens equal; {t.spread()}"))
    return out


def run(size: str = "full", repeats: int = 5, only: str = "reference,speedup") -> list[Row]:
    out = []
    if "reference" in only:
        out += reference_rows(size, repeats)
    if "speedup" in only:
        out += rows(size, repeats)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_kvcache", description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=list(SIZES), default="full")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--only", default="reference,speedup", help="subset of reference,speedup")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    with warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("ignore")
        table = run(a.size, a.repeats, a.only)
    print(markdown_table(HEADER, [r.cells() for r in table]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
