"""16 — BD3LM and GIDD-DiT on tiny RANDOM weights, and the noise-level probe.

Writes two tiny checkpoints in the hub layouts (`kuleshov-group/bd3lm-owt-block_size4`: `model_type: bd3lm`,
`backbone.*` + `sampling_eps_min/max`; `dvruette/gidd-small-p_unif-0.1`: `model_type: dit`, unprefixed names +
`rotary_emb.cos_cached/sin_cached`), loads them with `HookedMDM.from_pretrained`, and shows: BD3LM's training form
(x_t ⊕ x_0) and its block-by-block KV-cached form, the semi-AR sampler with and without the cache (same tokens),
GIDD's sampler, and the noise-level table (anchor attention share and adaLN gates over σ / t × layer) with its
figure. Random weights: the numbers show the mechanics, not what the trained models do.

    python examples/16_bd3lm_gidd.py
"""

import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from mdm_lens import HookedMDM
from mdm_lens.ddit.bd3lm import HookedBD3LM
from mdm_lens.ddit.gidd import HookedGIDD
from mdm_lens.ddit.hub import bd3lm_config, gidd_config
from mdm_lens.ddit.loading import ddit_plan
from mdm_lens.probes.noise_level import noise_level, plot_noise_level


def write(folder: Path, config: dict, family: str) -> None:
    """A random realistic model saved under the hub's names."""
    cfg = (bd3lm_config if family == "bd3lm" else gidd_config)(config, family, folder / "config.json")
    model = (HookedBD3LM if family == "bd3lm" else HookedGIDD).from_config(cfg, seed=0, init_std=0.2)
    state = {hub: model.state_dict()[ours].contiguous() for ours, hub in ddit_plan(cfg).items()}
    d = cfg.d_head
    if family == "gidd":  # no prefix, and the persistent rotary tables [1, max_seq_len, 3, 1, d_head]
        state = {k.removeprefix("backbone."): v for k, v in state.items()}
        inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
        emb = torch.outer(torch.arange(cfg.n_ctx).float(), inv).repeat(1, 2)
        cos, sin = emb.cos()[None, :, None, None].repeat(1, 1, 3, 1, 1), emb.sin()[None, :, None, None].repeat(1, 1, 3, 1, 1)
        cos[:, :, 2], sin[:, :, 2] = 1.0, 0.0
        state.update({"rotary_emb.cos_cached": cos, "rotary_emb.sin_cached": sin})
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    save_file(state, str(folder / "model.safetensors"))


@torch.no_grad()
def main() -> None:
    root = Path(tempfile.mkdtemp())
    write(root / "bd3lm", dict(model_type="bd3lm", architectures=["BD3LM"], block_size=4, vocab_size=50,
                               model_length=32, hidden_dim=32, cond_dim=16, n_blocks=2, n_heads=4,
                               attn_backend="sdpa"), "bd3lm")
    write(root / "gidd", dict(model_type="dit", architectures=["DIT"], vocab_size=50, max_seq_len=24, hidden_size=32,
                              timestep_cond_dim=16, num_hidden_layers=2, num_attention_heads=2, p_uniform=0.1),
          "gidd")
    bd3 = HookedMDM.from_pretrained(str(root / "bd3lm"), load_tokenizer=False)
    gidd = HookedMDM.from_pretrained(str(root / "gidd"), load_tokenizer=False)
    print(bd3, gidd, sep="\n")

    x0 = torch.randint(0, 49, (1, 32))
    xt = torch.where(torch.rand(1, 32) < 0.5, torch.tensor(49), x0)
    print("training form (x_t ⊕ x_0) logits:", tuple(bd3(xt, x0=x0).shape))
    cache = bd3.new_kv_cache(1)
    for b in range(3):  # three clean blocks into the cache, then one noisy block against them
        bd3(x0[:, 4 * b:4 * b + 4], kv_cache=cache, store_kv=True)
    cached = bd3(xt[:, 12:16], kv_cache=cache)
    window = bd3(torch.cat([x0[:, :12], xt[:, 12:16]], 1))[:, 12:]
    print(cache, "| cached vs recomputed logits, max diff:", float((cached - window).abs().max()))

    prompt = torch.tensor([[1]])
    plain = bd3.generate(prompt, gen_length=31, steps=16, seed=0)
    fast = bd3.generate(prompt, gen_length=31, steps=16, seed=0, kv_cache=True)
    print("BD3LM semi-AR, same tokens with the KV cache:", torch.equal(plain.tokens, fast.tokens),
          "| forwards:", plain.trajectory.n_steps, "vs", fast.trajectory.n_steps)
    out = gidd.generate(torch.tensor([[3, 4]]), gen_length=22, steps=16, seed=0)
    print("GIDD sample:", out.tokens[0].tolist())

    canvas = torch.cat([x0[:, :20], torch.full((1, 12), 49)], 1)
    table = noise_level(bd3, canvas, [0.0, 0.5, 2.0, 6.0], queries="masked")
    print(table.meaning)
    for row in table.table()[:4]:
        print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
    g = noise_level(gidd, torch.cat([torch.tensor([[3, 4]]), torch.full((1, 22), 49)], 1), [0.05, 0.5, 0.95],
                    queries="masked")
    fig = plot_noise_level(g)
    fig.savefig(root / "noise_level_gidd.png", dpi=80)
    print("figure:", root / "noise_level_gidd.png")


if __name__ == "__main__":
    main()
