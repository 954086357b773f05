"""07 — DiffusionGemma through the bridge: transformers' own model with TransformerLens hooks, its real
sampler step by step, and the floating probes on the decoder (the canvas).

Runs on a tiny model with RANDOM weights (no download); pass a checkpoint folder or a cached hub id
(e.g. google/diffusiongemma-26B-A4B-it, bf16, device_map="auto") to run the real model.

    python examples/07_diffusion_gemma.py [--model PATH_OR_HUB_ID] [--device-map auto]
"""

import argparse

import torch

from mdm_lens import HookedMDM, ReceivedAttention, steps
from mdm_lens.bridge import TransformersBridge
from mdm_lens.bridge.probes import qk_at_step
from mdm_lens.bridge.tiny import tiny_diffusion_gemma
from mdm_lens.probes.run import absorption_by_layer, anchors_over_steps, drift_from_output, qk_at_layer


def main(model_name: str | None, device_map: str | None) -> None:
    if model_name is None:
        print("tiny DiffusionGemma with RANDOM weights: the numbers check the machinery, they are not findings")
        model = TransformersBridge(tiny_diffusion_gemma(seed=0))
        prompt = torch.randint(2, model.cfg.d_vocab, (1, 12), generator=torch.Generator().manual_seed(0))
        settings = dict(max_new_tokens=16, max_denoising_steps=4)
    else:
        model = HookedMDM.from_pretrained(model_name, dtype=torch.bfloat16, device_map=device_map)
        prompt = model.to_tokens("Question: Why is the sky blue?\nAnswer:")
        settings = dict(max_new_tokens=256)  # the checkpoint's own generation settings otherwise
    print(model)

    # one forward: canvas logits, and every decoder pattern (keys = prompt + canvas)
    canvas = torch.randint(0, model.cfg.d_vocab, (1, model.cfg.extra["canvas_length"]), device=model.W_E.device)
    logits, cache = model.run_with_cache(prompt, decoder_input_ids=canvas,
                                         names_filter=lambda n: n.endswith("attn.hook_pattern"))
    print("canvas logits", tuple(logits.shape), "| decoder pattern", tuple(cache["pattern", 0].shape),
          "| encoder pattern", tuple(cache["encoder.0.attn.hook_pattern"].shape))

    # the real sampler, step by step: received attention of the not-yet-accepted canvas rows at every step,
    # and the q/k/v/pattern of one decoder layer at two steps for the QK split
    layer = model.cfg.n_layers - 1
    names = [f"blocks.{layer}.attn.{n}" for n in ("hook_rot_q", "hook_rot_k", "hook_v", "hook_pattern")]
    out = model.generate(prompt, seed=0, record=[ReceivedAttention(query="masked")], cache=names @ steps(0, 1),
                         **settings)
    print(out)
    anchors = anchors_over_steps(out, layer=layer)
    print("anchor keys per step (row 0):", [a.nonzero().flatten().tolist() for a in anchors.anchors[0]])
    drift = drift_from_output(out, layer=layer)
    print("mean Jaccard of consecutive anchor sets:", drift.mean_jaccard)
    qk = qk_at_step(out, 1, layer)
    print("QK split at step 1: anchor", qk.anchor[0].tolist(), "norm share", qk.norm_share_mean)

    # whole-sequence probes on the final sequence: prompt -> encoder, answer -> decoder canvas
    P = out.prompt_length
    print(absorption_by_layer(model, out.tokens, prompt_length=P).table().round(2))
    final = qk_at_layer(model, out.tokens, layer, prompt_length=P)
    print("QK split on the final sequence: anchor", final.anchor[0].tolist(), "norm share", final.norm_share_mean)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--device-map", default=None)
    a = p.parse_args()
    main(a.model, a.device_map)
