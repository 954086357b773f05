"""Material for the report's DiffusionGemma section: a tiny **random-weight** DiffusionGemma
(transformers' own class), one short `generate` with `ReceivedAttention`, a figure and a table.

Random weights: the numbers show that the machinery runs end to end (encoder pass, denoiser steps,
acceptance, received attention over the prompt and the canvases), not anything about the real model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch

from mdm_lens import validate

LABEL = "DiffusionGemma, tiny model with RANDOM weights (machinery check, not a finding)"


@dataclass
class DiffusionGemmaSection:
    title: str
    png: Path  # received attention over steps × keys, head mean, one decoder layer
    table: pd.DataFrame  # one row per denoising step
    note: str


def diffusion_gemma_section(out_dir: str | Path, *, seed: int = 0, layer: int = -1, prompt_length: int = 12,
                            max_new_tokens: int = 16, max_denoising_steps: int = 4) -> DiffusionGemmaSection:
    """Build the tiny random model, generate two canvases with `ReceivedAttention(query="masked")`, and write
    `diffusion_gemma_received.png` into `out_dir`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mdm_lens.bridge import TransformersBridge
    from mdm_lens.bridge.tiny import tiny_diffusion_gemma
    from mdm_lens.hooks.reducers import ReceivedAttention
    from mdm_lens.probes import run

    validate.integer(prompt_length, name="prompt_length", min=1)
    validate.integer(max_new_tokens, name="max_new_tokens", min=1)
    validate.integer(max_denoising_steps, name="max_denoising_steps", min=1)
    model = TransformersBridge(tiny_diffusion_gemma(seed=seed))
    layer = validate.index(layer, model.cfg.n_layers, name="layer", what="decoder layers")
    prompt = torch.randint(2, model.cfg.d_vocab, (1, prompt_length), generator=torch.Generator().manual_seed(seed))
    out = model.generate(prompt, seed=seed, max_new_tokens=max_new_tokens, max_denoising_steps=max_denoising_steps,
                         record=[ReceivedAttention(query="masked")], stability_threshold=None,
                         confidence_threshold=None)
    received = out.records["received_attention"][:, 0, layer].mean(1)  # [step, key]
    anchors = run.anchors_over_steps(out, layer=layer).anchors[0]  # [step, key]

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    png = out_dir / "diffusion_gemma_received.png"
    fig, ax = plt.subplots(figsize=(7, 3.2))
    im = ax.imshow(received.numpy(), aspect="auto", cmap="viridis", interpolation="nearest")
    canvas = model.cfg.extra["canvas_length"]
    for edge in range(prompt_length, received.shape[1] + 1, canvas):
        ax.axvline(edge - 0.5, color="white", lw=1, ls="--")
    ax.set_xlabel("key position (prompt | canvas 0 | canvas 1 …)")
    ax.set_ylabel("denoising step")
    ax.set_title(f"received attention, decoder layer {layer}, not-yet-committed queries\n{LABEL}", fontsize=8)
    fig.colorbar(im, ax=ax, label="mass (head mean)")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)

    traj = out.trajectory
    finite = torch.nan_to_num(received, nan=-1.0)
    table = pd.DataFrame({
        "step": list(range(out.n_steps)),
        "canvas": traj.block_of_step.tolist(),
        "accepted": traj.accepted[:, 0].sum(-1).tolist(),
        "top key": finite.argmax(-1).tolist(),
        "top mass": finite.max(-1).values.round(decimals=3).tolist(),
        "prompt mass": received[:, :prompt_length].sum(-1).round(decimals=3).tolist(),
        "anchors": [anchors[s].nonzero().flatten().tolist() for s in range(out.n_steps)],
    })
    note = (f"{LABEL}. transformers' DiffusionGemmaForBlockDiffusion ({model.cfg.n_layers} layers, both attention "
            f"types, MoE) run through the bridge; {out.n_steps} steps, {out.settings['canvases']} canvases of "
            f"{canvas}; keys of a later canvas do not exist during an earlier one (blank).")
    return DiffusionGemmaSection(title="DiffusionGemma (random weights)", png=png, table=table, note=note)
