"""15 — MDLM and Duo (the DDiT research diffusion LMs) on tiny RANDOM weights.

Writes two tiny checkpoints in the hub layouts (`kuleshov-group/mdlm-owt`: config.json `model_type: mdlm` +
model.safetensors with `backbone.*` keys; `s-sahoo/duo`: `model_type: duo` + pytorch_model.bin), loads them with
`HookedMDM.from_pretrained` (which returns a `HookedDDiT`), and shows: the σ-conditioning hooks, patching the
conditioning vector from one σ into another forward, and the MDLM / Duo samplers step by step. Random weights: the
numbers show the mechanics, not what the trained models do.

    python examples/15_mdlm_duo.py
"""

import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from mdm_lens import HookedMDM
from mdm_lens.ddit import HookedDDiT, ddit_config
from mdm_lens.ddit.loading import ddit_plan


def write(folder: Path, config: dict, family: str, fmt: str) -> None:
    """A random realistic model saved under the hub's names (our names → `backbone.*` via the loader's plan)."""
    cfg = ddit_config(family, d_vocab=config["vocab_size"], n_ctx=config["model_length"],
                      d_model=config["hidden_dim"], cond_dim=config["cond_dim"], n_layers=config["n_blocks"],
                      n_heads=config["n_heads"], time_conditioning=config.get("time_conditioning", True))
    model = HookedDDiT.from_config(cfg, seed=0, init_std=0.2)
    state = {hub: model.state_dict()[ours].contiguous() for ours, hub in ddit_plan(cfg).items()}
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    if fmt == "safetensors":
        save_file(state, str(folder / "model.safetensors"))
    else:
        torch.save(state, folder / "pytorch_model.bin")


def main() -> None:
    root = Path(tempfile.mkdtemp())
    write(root / "mdlm", dict(model_type="mdlm", architectures=["MDLM"], vocab_size=50, model_length=32,
                              hidden_dim=32, cond_dim=16, n_blocks=2, n_heads=4, time_conditioning=False),
          "mdlm", "safetensors")
    write(root / "duo", dict(model_type="duo", architectures=["DUO"], vocab_size=50, model_length=32, hidden_dim=32,
                             cond_dim=16, n_blocks=2, n_heads=4), "duo", "bin")
    mdlm = HookedMDM.from_pretrained(str(root / "mdlm"), load_tokenizer=False)
    duo = HookedMDM.from_pretrained(str(root / "duo"), load_tokenizer=False)
    print(mdlm, duo, sep="\n")

    tokens = torch.randint(0, 49, (1, 16))
    _, cache = duo.run_with_cache(tokens, sigma=0.5, names_filter=lambda n: "adaLN" in n or n == "hook_cond")
    print("Duo, σ=0.5: |gate_msa| per block",
          [round(float(cache[f"blocks.{i}.adaLN.hook_gate_msa"].abs().mean()), 3) for i in range(2)])
    # the whole σ dependence goes through hook_cond: patching it from σ=0.5 into a σ=3 forward gives the σ=0.5 logits
    patched = duo.run_with_hooks(tokens, sigma=3.0, fwd_hooks=[("hook_cond", lambda t, hook: cache["hook_cond"])])
    print("max |patched(σ=3 ← cond of σ=0.5) − forward(σ=0.5)| =", float((patched - duo(tokens, sigma=0.5)).abs().max()))

    prompt = torch.tensor([[3, 14, 15]])
    out = mdlm.generate(prompt, steps=24, gen_length=12, predictor="ddpm_cache")
    print("MDLM ddpm_cache:", out.tokens[0].tolist())
    out = duo.generate(prompt, steps=8, gen_length=12, noise_removal="greedy")  # the distilled few-step setting
    print("Duo 8 steps, greedy:", out.tokens[0].tolist())


if __name__ == "__main__":
    with torch.no_grad():
        main()
