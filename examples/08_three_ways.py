"""08 — One experiment written three ways: mdm_lens step hooks, TransformerLens-style `run_with_hooks` on a
replayed canvas, and nnsight (`mdm_lens.nnsight.DiffusionLM`, where `tracer.iter[k]` is denoising step k).

The experiment: at denoising step K, ablate every head of one layer (layer 0 by default) (zero its `hook_z`), and read that
layer's attention pattern and the step's logits; then see what the ablation does to the generation.

    python examples/08_three_ways.py [--step 0] [--layer 0]

The first and third ways run the real sampler, so they also give the ablated run's final tokens; the
TransformerLens way sees one forward (the canvas before step K, replayed from a clean run), which is all
that is needed for what happens *at* step K, and nothing after it. All three agree exactly.
"""

import argparse

import torch

from mdm_lens import at_steps, steps
from mdm_lens.nnsight import DiffusionLM
from mdm_lens.zoo import data as D
from mdm_lens.zoo import tokenizer as ZT
from _common import load  # noqa: E402  (examples/ is on sys.path when run as a script)

GEN = dict(steps=4, gen_length=4, block_length=4, progress=False)


def ablate_heads(z, hook):  # z: [batch, pos, head, d_head]
    z[:] = 0
    return z


def with_step_hooks(model, ids, k, layer):
    """1. mdm_lens: a hook bound to step K, and a cache request for the same step."""
    last = f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"  # the logits are read from the final residual
    out = model.generate(ids, fwd_hooks=[at_steps(ablate_heads, [k], name=f"blocks.{layer}.attn.hook_z")],
                         cache=[f"blocks.{layer}.attn.hook_pattern", last] @ steps(k), **GEN)
    step = out.cache[k]
    logits = model.unembed(model.ln_final(step[last]))
    return step[f"blocks.{layer}.attn.hook_pattern"], logits, out.tokens


def with_run_with_hooks(model, ids, k, layer):
    """2. TransformerLens: replay the canvas the sampler fed the model at step K, one hooked forward."""
    canvas = model.generate(ids, **GEN).trajectory.x_steps[k]  # before step K the ablation has changed nothing
    saved = {}

    def save(pattern, hook):
        saved["pattern"] = pattern.clone()

    logits = model.run_with_hooks(canvas, fwd_hooks=[(f"blocks.{layer}.attn.hook_z", ablate_heads),
                                                     (f"blocks.{layer}.attn.hook_pattern", save)])
    return saved["pattern"], logits, None  # what comes after step K is out of reach


def with_nnsight(model, ids, k, layer):
    """3. nnsight: the same trace body nnsight users write for generation, with steps for tokens."""
    lm = DiffusionLM(model)
    with lm.generate(ids, **GEN) as tracer:
        for _ in tracer.iter[k]:
            pattern = lm.blocks[layer].attn.hook_pattern.output.save()
            lm.blocks[layer].attn.hook_z.output[:] = 0
            logits = lm.output.save()
        out = lm.generator.output.save()
    return pattern, logits, out.tokens


def main(k: int, layer: int) -> None:
    model = load("mdm-lens/tiny-mdm")
    item = D.make_dataset(1, seed=7, n_distractors=1)[0]
    ids = torch.tensor(ZT.encode(item.prompt))[None]
    layer %= model.cfg.n_layers
    results = {f.__doc__.split(":")[0]: f(model, ids, k, layer)
               for f in (with_step_hooks, with_run_with_hooks, with_nnsight)}
    (p1, l1, t1), (p2, l2, t2), (p3, l3, t3) = results.values()
    clean = model.generate(ids, **GEN).tokens
    print(f"prompt: {item.prompt!r}  ({ids.shape[1]} tokens), ablation at step {k}, layer {layer}, all heads")
    for name, (p, lg, t) in results.items():
        print(f"  {name:>4}  pattern {tuple(p.shape)}  step-{k} logits {tuple(lg.shape)}  "
              f"final tokens: {'—' if t is None else ZT.decode(t[0, ids.shape[1]:].tolist())!r}")
    print(f"max |Δ| pattern  1-2 {float((p1 - p2).abs().max()):.1e}  1-3 {float((p1 - p3).abs().max()):.1e}")
    print(f"max |Δ| logits   1-2 {float((l1 - l2).abs().max()):.1e}  1-3 {float((l1 - l3).abs().max()):.1e}")
    print(f"final tokens 1 == 3: {torch.equal(t1, t3)};  changed by the ablation: {not torch.equal(t1, clean)} "
          f"(clean: {ZT.decode(clean[0, ids.shape[1]:].tolist())!r})")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--step", type=int, default=0)
    ap.add_argument("--layer", type=int, default=0)
    args = ap.parse_args()
    with torch.no_grad():
        main(args.step, args.layer)
