"""Tiny random MDLM / Duo checkpoints in their hub layouts (`kuleshov-group/mdlm-owt`, `s-sahoo/duo`):
config.json keys as the hub config classes name them, `backbone.` + the DDiT module names, including the
persistent `backbone.rotary_emb.inv_freq` buffer. Norm weights log-normal around 1, every bias and adaLN bias
drawn non-zero, adaLN matrices large enough that the modulation matters."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from mdm_lens.init import bias_draw, norm_weight_draw

MDLM_CONFIG = dict(architectures=["MDLM"], model_type="mdlm", return_dict=False,
                   auto_map={"AutoConfig": "configuration_mdlm.MDLMConfig",
                             "AutoModelForMaskedLM": "modeling_mdlm.MDLM"},
                   vocab_size=61, model_length=24, hidden_dim=48, cond_dim=20, n_blocks=2, n_heads=4, dropout=0.1,
                   time_conditioning=False)
DUO_CONFIG = dict(architectures=["DUO"], model_type="duo", return_dict=False,
                  auto_map={"AutoConfig": "model.DUOConfig", "AutoModelForMaskedLM": "model.DUO"},
                  vocab_size=53, model_length=20, hidden_dim=32, cond_dim=24, n_blocks=2, n_heads=2, dropout=0.1,
                  causal=False)


def hub_state_dict(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    d, c, v, n = config["hidden_dim"], config["cond_dim"], config["vocab_size"], config["n_blocks"]
    hd = d // config["n_heads"]

    def mat(*shape: int, scale: float = 0.1) -> torch.Tensor:
        return scale * torch.randn(*shape, generator=g)

    sd = {"backbone.vocab_embed.embedding": mat(v, d, scale=1.0),
          "backbone.sigma_map.mlp.0.weight": mat(c, 256, scale=0.2), "backbone.sigma_map.mlp.0.bias": bias_draw((c,), 0.2, g),
          "backbone.sigma_map.mlp.2.weight": mat(c, c, scale=0.3), "backbone.sigma_map.mlp.2.bias": bias_draw((c,), 0.2, g),
          "backbone.rotary_emb.inv_freq": 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))}
    for i in range(n):
        b = f"backbone.blocks.{i}."
        sd.update({b + "norm1.weight": norm_weight_draw((d,), g), b + "norm2.weight": norm_weight_draw((d,), g),
                   b + "attn_qkv.weight": mat(3 * d, d, scale=0.3), b + "attn_out.weight": mat(d, d, scale=0.2),
                   b + "mlp.0.weight": mat(4 * d, d, scale=0.15), b + "mlp.0.bias": bias_draw((4 * d,), 0.1, g),
                   b + "mlp.2.weight": mat(d, 4 * d, scale=0.1), b + "mlp.2.bias": bias_draw((d,), 0.1, g),
                   b + "adaLN_modulation.weight": mat(6 * d, c, scale=0.3),
                   b + "adaLN_modulation.bias": bias_draw((6 * d,), 0.3, g)})
    sd.update({"backbone.output_layer.norm_final.weight": norm_weight_draw((d,), g),
               "backbone.output_layer.linear.weight": mat(v, d, scale=0.5),
               "backbone.output_layer.linear.bias": bias_draw((v,), 0.3, g),
               "backbone.output_layer.adaLN_modulation.weight": mat(2 * d, c, scale=0.3),
               "backbone.output_layer.adaLN_modulation.bias": bias_draw((2 * d,), 0.3, g)})
    return sd


def write_ddit(folder: Path, config: dict, seed: int = 0, fmt: str = "safetensors", drop: tuple[str, ...] = ()
               ) -> tuple[Path, dict[str, torch.Tensor]]:
    """Write config.json (minus the keys in `drop`, which then take the class defaults) and the weights as
    model.safetensors or pytorch_model.bin; returns the folder and the state dict."""
    folder.mkdir(parents=True, exist_ok=True)
    sd = hub_state_dict(config, seed)
    (folder / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k not in drop}))
    if fmt == "safetensors":
        save_file({k: t.contiguous() for k, t in sd.items()}, str(folder / "model.safetensors"))
    else:
        torch.save(sd, folder / "pytorch_model.bin")
    return folder, sd
