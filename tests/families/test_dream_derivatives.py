"""Dream derivatives whose config says `DreamModel` (Dream-Coder-v0-7B, DiffuCoder-7B; spec families-2.md §8) load
with the unchanged Dream loader: tiny checkpoints in their layouts, with their own special tokens, generation
configs and the extra keys their hubs/trainers write, forward exact against the bidirectional Qwen2 reference
(shifted logits), and their own ids — not Dream's constants — in `model.cfg`."""

from __future__ import annotations

import json

import pytest
import torch

from mdm_lens import HookedMDM
from tiny_checkpoints import hf_reference, write_dream

TOKENS = torch.tensor([[5, 17, 3, 95, 95, 60, 2, 41], [9, 95, 8, 33, 12, 95, 95, 70]])
# Dream-Coder-v0-Instruct-7B: Qwen2.5-Coder init, im_end as EOS in generation_config.json, its trainer writes
# `eos_penalty` into the model config (read by hub code only). Ids are moved into this 97-token vocabulary.
DREAM_CODER = dict(
    config=dict(mask_token_id=95, pad_token_id=93, bos_token_id=94, eos_token_id=94, eos_penalty=3.0,
                rope_theta=1e6, torch_dtype="bfloat16", transformers_version="4.46.2"),
    generation=dict(bos_token_id=94, eos_token_id=[92, 94], pad_token_id=93, temperature=0.1, top_p=0.95,
                    alg="entropy", alg_temp=0.0, steps=768, max_new_tokens=768),
    tokens={95: "<|mask|>", 94: "<|endoftext|>", 93: "<|dlm_pad|>", 92: "<|im_end|>"},
    expect=dict(mask_token_id=95, pad_token_id=93, bos_token_id=94, eos_token_id=94),
)
# DiffuCoder-7B-Instruct: Instruct output is cut at `<|dlm_pad|>` (its pad token); no eos in config.json, the
# generation config names im_end first.
DIFFUCODER = dict(
    config=dict(mask_token_id=95, pad_token_id=91, bos_token_id=94, rope_theta=1e6),
    generation=dict(bos_token_id=94, eos_token_id=[92, 94], pad_token_id=91, temperature=0.4, top_p=0.95,
                    alg="entropy", alg_temp=0.0),
    tokens={95: "<|mask|>", 94: "<|endoftext|>", 92: "<|im_end|>", 91: "<|dlm_pad|>"},
    expect=dict(mask_token_id=95, pad_token_id=91, bos_token_id=94, eos_token_id=92),
)


def _write(tmp_path, layout, seed):
    ref = hf_reference("dream", seed=seed, rope_theta=1e6)
    folder = write_dream(ref, tmp_path / "ckpt", config_overrides=layout["config"])
    (folder / "generation_config.json").write_text(json.dumps(layout["generation"]))
    added = {str(i): {"content": n, "special": True} for i, n in layout["tokens"].items()}
    (folder / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": added,
                                                              "pad_token": layout["tokens"][layout["expect"]["pad_token_id"]]}))
    return ref, folder


@pytest.mark.parametrize("layout", [DREAM_CODER, DIFFUCODER], ids=["dream-coder", "diffucoder"])
def test_dream_derivative_loads_with_its_own_ids_and_exact_forward(tmp_path, layout):
    ref, folder = _write(tmp_path, layout, seed=7)
    model = HookedMDM.from_pretrained(str(folder))
    assert model.cfg.family == "dream" and model.cfg.logit_shift
    for key, value in layout["expect"].items():
        assert getattr(model.cfg, key) == value, key
    assert model.cfg.extra["eos_token_ids"] == ([94] if "eos_token_id" in layout["config"] else [92, 94])
    with torch.no_grad():
        raw = ref(TOKENS, is_causal=False).logits
        expected = torch.cat([raw[:, :1], raw[:, :-1]], dim=1)
        got = model(TOKENS, return_type="aligned")
    assert (got - expected).abs().max() <= 1e-4 * expected.abs().max()


def test_dream_derivative_samples_with_the_dream_sampler(tmp_path):
    _, folder = _write(tmp_path, DIFFUCODER, seed=8)
    model = HookedMDM.from_pretrained(str(folder))
    out = model.generate(TOKENS[:1, :3], gen_length=6, steps=6, alg="entropy", temperature=0.0, top_p=None,
                         top_k=None)
    assert out.settings["alg"] == "entropy" and out.tokens.shape == (1, 9)
    assert not bool((out.tokens[:, 3:] == 95).any())  # every masked slot filled by DiffuCoder's own mask id
