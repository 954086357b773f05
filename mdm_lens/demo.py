"""`mdm-lens demo`. Until the zoo's trained twins land this runs a tiny *random* model end to end:
load → cache → attention pattern → received attention per key."""

from __future__ import annotations

from pathlib import Path

import torch

from mdm_lens import HookedMDM, MDMConfig


def run_demo(out: str = "mdm_lens_report", quick: bool = False) -> Path:
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = MDMConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_mlp=128, d_vocab=100, mask_token_id=99,
                    model_name="random-tiny-mdm")
    model = HookedMDM.from_config(cfg, seed=0, init_std=0.3)
    tokens = torch.randint(0, 99, (1, 12))
    tokens[0, 6:] = 99  # a half-masked canvas, as in a denoising step
    logits, cache = model.run_with_cache(tokens, names_filter=lambda n: n.endswith("hook_pattern"))
    print(model)
    for layer in range(cfg.n_layers):
        pattern = cache["pattern", layer][0]  # [head, query, key]
        received = pattern.mean(dim=(0, 1))  # mass share per key
        top = int(received.argmax())
        print(f"layer {layer}: most attended key {top} receives {100 * received[top]:.1f}% (uniform: "
              f"{100 / tokens.shape[1]:.1f}%)")
    (folder / "README.txt").write_text("mdm-lens demo (random tiny model); the trained zoo twins replace this.\n")
    print(f"wrote {folder.resolve()}")
    return folder
