"""Bridge rows: the DiffusionGemma bridge against transformers' own `DiffusionGemmaForBlockDiffusion`
on the same random weights, in one process, as ratios.

    python -m benchmarks.bench_bridge                 # CPU size below, 31 rounds, prints a table
    python -m benchmarks.bench_bridge --size tiny --repeats 1     # smoke size (what the test runs)

Rows: (1) a full forward (encode the prompt, denoise one canvas) with no hooks vs transformers' SDPA
forward; (2) the same with every decoder pattern captured (`run_with_cache(names_filter=blocks.*.
attn.hook_pattern)`) vs transformers' eager `output_attentions=True`; (3) one denoiser step on an
encoded prefix (the sampler's inner call) with no hooks vs transformers'. Each comparison first
checks that both sides agree (logits, and every pattern against eager), then times A/B/A/B rounds.
"""

from __future__ import annotations

import argparse
import copy
from dataclasses import dataclass

import torch

from benchmarks.bench_forward import check_close
from benchmarks.harness import HEADER, Row, alternate, plain_table, seconds


@dataclass(frozen=True)
class BridgeSize:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    global_head_dim: int
    experts: int
    vocab: int
    prompt: int
    canvas: int
    window: int

    def label(self) -> str:
        return (f"{self.layers}L d{self.hidden} {self.heads}/{self.kv_heads}h hd{self.head_dim}/{self.global_head_dim} "
                f"E{self.experts} V{self.vocab}, prompt {self.prompt} + canvas {self.canvas}")


SIZES = {
    "full": BridgeSize("full", hidden=512, layers=6, heads=8, kv_heads=4, head_dim=64, global_head_dim=128, experts=8,
                       vocab=4096, prompt=192, canvas=64, window=128),
    "tiny": BridgeSize("tiny", hidden=32, layers=3, heads=4, kv_heads=2, head_dim=8, global_head_dim=16, experts=4,
                       vocab=128, prompt=7, canvas=8, window=4),
}


def build(size: BridgeSize):
    from mdm_lens.bridge import TransformersBridge
    from mdm_lens.bridge.tiny import tiny_diffusion_gemma

    layer_types = ["sliding_attention" if (i + 1) % 3 else "full_attention" for i in range(size.layers)]
    layer_types[-1] = "full_attention"
    ref = tiny_diffusion_gemma(seed=0, vocab_size=size.vocab, hidden_size=size.hidden, n_layers=size.layers,
                               n_heads=size.heads, n_kv_heads=size.kv_heads, head_dim=size.head_dim,
                               global_head_dim=size.global_head_dim, layer_types=layer_types,
                               sliding_window=size.window, num_experts=size.experts, canvas_length=size.canvas)
    eager = copy.deepcopy(ref)
    eager.set_attn_implementation("eager")
    bridge = TransformersBridge(copy.deepcopy(ref))
    return ref, eager, bridge


def run(size: BridgeSize, repeats: int) -> list[Row]:
    from transformers import DynamicCache

    ref, eager, bridge = build(size)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, size.vocab, (1, size.prompt), generator=g)
    canvas = torch.randint(0, size.vocab, (1, size.canvas), generator=g)
    label = size.label()
    rows = []

    ours = lambda: bridge(ids, decoder_input_ids=canvas)  # noqa: E731
    theirs = lambda: ref(input_ids=ids, decoder_input_ids=canvas).logits  # noqa: E731
    d = check_close(ours(), theirs(), "bridge logits")
    t = alternate(ours, theirs, repeats)
    rows.append(Row("B1 forward", f"bridge, no hooks vs DiffusionGemmaForBlockDiffusion sdpa, {label}",
                    seconds(t.a_med), seconds(t.b_med), t.ratio, "≤ 1.05", t.ratio <= 1.05,
                    f"encoder + decoder; max|Δ| {d:.1e}; {t.spread()}"))

    def is_decoder_pattern(n: str) -> bool:
        return n.startswith("blocks.") and n.endswith("attn.hook_pattern")

    ours_p = lambda: bridge.run_with_cache(ids, decoder_input_ids=canvas, names_filter=is_decoder_pattern)  # noqa: E731
    theirs_p = lambda: eager(input_ids=ids, decoder_input_ids=canvas, output_attentions=True)  # noqa: E731
    logits, cache = ours_p()
    out = theirs_p()
    d = check_close(logits, out.logits, "pattern-run logits")
    for layer, att in enumerate(out.attentions):  # sliding layers: eager has only the window's keys
        d = max(d, check_close(cache[f"blocks.{layer}.attn.hook_pattern"][..., -att.shape[-1]:], att, f"layer {layer}"))
    t = alternate(ours_p, theirs_p, repeats)
    rows.append(Row("B2 patterns", f"all decoder patterns vs eager output_attentions, {label}", seconds(t.a_med),
                    seconds(t.b_med), t.ratio, "≤ 1.0", t.ratio <= 1.0, f"max|Δ| {d:.1e}; {t.spread()}"))

    c_ours = DynamicCache(config=bridge.hf.config.get_text_config(decoder=True))
    c_ref = DynamicCache(config=ref.config.get_text_config(decoder=True))
    bridge.encode(ids, c_ours)
    ref.model.encoder(input_ids=ids, cache=c_ref)
    ours_s = lambda: bridge(decoder_input_ids=canvas, cache=c_ours)  # noqa: E731  (the decoder never writes it)
    theirs_s = lambda: ref(decoder_input_ids=canvas, cache=c_ref).logits  # noqa: E731
    d = check_close(ours_s(), theirs_s(), "denoiser-step logits")
    t = alternate(ours_s, theirs_s, repeats)
    rows.append(Row("B3 denoiser step", f"decoder on a cached prefix, no hooks, {label}", seconds(t.a_med),
                    seconds(t.b_med), t.ratio, "≤ 1.05", t.ratio <= 1.05, f"max|Δ| {d:.1e}; {t.spread()}"))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_bridge", description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=list(SIZES), default="full")
    p.add_argument("--repeats", type=int, default=31)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    with torch.inference_mode():
        rows = run(SIZES[args.size], args.repeats)
    print(plain_table(HEADER, [r.cells() for r in rows]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
