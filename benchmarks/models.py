"""The benchmark models: one random-weight `transformers` Llama per size, and the same weights as a
HookedMDM (LLaDA-format checkpoint → bidirectional; `save_pretrained` Llama folder → causal).

Nothing here depends on the test suite: the LLaDA writer below is the mapping of
architectures.md §12.2 (LLaDA → Llama), applied in reverse.
"""

from __future__ import annotations

import copy
import json
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file


@dataclass(frozen=True)
class Size:
    """A model shape and the sequence lengths the benchmarks use with it."""

    name: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_mlp: int
    vocab: int
    seq: int  # T for the forward / pattern / trajectory benchmarks
    seq_long: int  # extra T for the forward benchmark (item 1)
    steps: int  # denoising steps = gen_length (item 3)
    mem_seqs: tuple[int, ...]  # T values of the memory table (item 4)
    deep_layers: int  # the "many layers, small d" variant of item 3 (0 = skip)
    deep_d_model: int
    deep_heads: int
    deep_d_mlp: int
    deep_steps: int

    def label(self) -> str:
        return (f"{self.n_layers}L d{self.d_model} {self.n_heads}/{self.n_kv_heads}h mlp{self.d_mlp} "
                f"V{self.vocab}")

    def with_kv(self, n_kv: int) -> "Size":
        return replace(self, n_kv_heads=n_kv, name=f"{self.name}-gqa{self.n_heads}/{n_kv}")

    def deep(self) -> "Size":
        return replace(self, name=f"{self.name}-deep", n_layers=self.deep_layers, d_model=self.deep_d_model,
                       n_heads=self.deep_heads, n_kv_heads=self.deep_heads, d_mlp=self.deep_d_mlp,
                       steps=self.deep_steps)


SIZES = {
    # the setting: matmuls dominate at T = 256
    "full": Size("full", n_layers=8, d_model=512, n_heads=8, n_kv_heads=8, d_mlp=1376, vocab=4096, seq=256,
                 seq_long=512, steps=32, mem_seqs=(64, 128, 256), deep_layers=32, deep_d_model=256, deep_heads=4,
                 deep_d_mlp=688, deep_steps=8),
    # smoke-test size: everything runs, nothing is meaningful
    "tiny": Size("tiny", n_layers=2, d_model=64, n_heads=4, n_kv_heads=4, d_mlp=96, vocab=128, seq=24,
                 seq_long=32, steps=4, mem_seqs=(12, 24), deep_layers=4, deep_d_model=32, deep_heads=2,
                 deep_d_mlp=48, deep_steps=2),
}

MASK_OFFSET = 1  # mask id = vocab - 1; prompts are drawn below it
EOS_ID = 1


def hf_config(size: Size, attn: str = "sdpa"):
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=size.d_model, intermediate_size=size.d_mlp, num_hidden_layers=size.n_layers,
                      num_attention_heads=size.n_heads, num_key_value_heads=size.n_kv_heads, vocab_size=size.vocab,
                      rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False,
                      mlp_bias=False, is_causal=False, max_position_embeddings=max(1024, 2 * size.seq_long),
                      bos_token_id=0, eos_token_id=EOS_ID, pad_token_id=EOS_ID)
    cfg._attn_implementation = attn
    return cfg


def hf_llama(size: Size, seed: int = 0, attn: str = "sdpa") -> Any:
    """A non-causal (`is_causal=False`) LlamaForCausalLM with random weights: N(0, 1/d) matrices (so
    attention is not uniform) and norm weights 1 ± 0.1 (a skipped norm would show)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(hf_config(size, attn))
    g = torch.Generator().manual_seed(seed)
    std = size.d_model ** -0.5
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))
    return model.eval()


def with_attn(model: Any, attn: str) -> Any:
    """An independent copy of `model` with another attention implementation (same weights)."""
    from transformers import LlamaForCausalLM

    cfg = copy.deepcopy(model.config)
    cfg._attn_implementation = attn
    other = LlamaForCausalLM(cfg)
    other.load_state_dict(model.state_dict())
    return other.eval()


_LLADA_NAMES = [("input_layernorm", "attn_norm"), ("self_attn.q_proj", "q_proj"), ("self_attn.k_proj", "k_proj"),
                ("self_attn.v_proj", "v_proj"), ("self_attn.o_proj", "attn_out"),
                ("post_attention_layernorm", "ff_norm"), ("mlp.gate_proj", "ff_proj"), ("mlp.up_proj", "up_proj"),
                ("mlp.down_proj", "ff_out")]


def write_llada(model: Any, folder: Path) -> Path:
    """The Llama's weights as an LLaDA checkpoint (LLaDA key names and config keys)."""
    c = model.config
    sd = model.state_dict()
    out = {"model.transformer.wte.weight": sd["model.embed_tokens.weight"],
           "model.transformer.ln_f.weight": sd["model.norm.weight"],
           "model.transformer.ff_out.weight": sd["lm_head.weight"]}
    for i in range(c.num_hidden_layers):
        for src, dst in _LLADA_NAMES:
            out[f"model.transformer.blocks.{i}.{dst}.weight"] = sd[f"model.layers.{i}.{src}.weight"]
    config = {
        "architectures": ["LLaDAModelLM"], "model_type": "llada",
        "d_model": c.hidden_size, "n_heads": c.num_attention_heads, "n_kv_heads": c.num_key_value_heads,
        "n_layers": c.num_hidden_layers, "mlp_hidden_size": c.intermediate_size, "mlp_ratio": 4,
        "vocab_size": c.vocab_size, "embedding_size": c.vocab_size, "max_sequence_length": c.max_position_embeddings,
        "rope": True, "rope_full_precision": True, "rope_theta": 500000.0, "alibi": False, "layer_norm_type": "rms",
        "rms_norm_eps": 1e-5, "layer_norm_with_affine": True, "bias_for_layer_norm": False,
        "attention_layer_norm": False, "include_bias": False, "include_qkv_bias": False, "weight_tying": False,
        "scale_logits": False, "input_emb_norm": False, "activation_type": "silu", "block_type": "llama",
        "block_group_size": 1, "multi_query_attention": None, "mask_token_id": c.vocab_size - MASK_OFFSET,
        "eos_token_id": EOS_ID, "pad_token_id": EOS_ID, "use_cache": False,
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.detach().contiguous().clone() for k, v in out.items()}, str(folder / "model.safetensors"))
    return folder


def word_tokenizer(vocab: int, folder: Path) -> Any:
    """A word-level tokenizer `t0 … t{V-1}` saved into `folder` (the TL bridge reloads it by path)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t2"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="t0", eos_token=f"t{EOS_ID}",
                                  pad_token=f"t{EOS_ID}", unk_token="t2")
    tok.save_pretrained(folder)
    return PreTrainedTokenizerFast.from_pretrained(str(folder))


class Workspace:
    """Owns the temporary folders; builds every implementation of one `Size` from one set of weights."""

    def __init__(self) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="mdm_lens_bench_")
        self.root = Path(self._tmp.name)
        self._n = 0

    def folder(self, tag: str) -> Path:
        self._n += 1
        path = self.root / f"{self._n:02d}-{tag.replace('/', '_')}"
        path.mkdir(parents=True)
        return path

    def ours(self, hf_model: Any, causal: bool = False) -> Any:
        """The HookedMDM twin: LLaDA folder (bidirectional) or the HF Llama folder (causal)."""
        from mdm_lens import HookedMDM

        folder = self.folder("hf" if causal else "llada")
        if causal:
            hf_model.save_pretrained(folder)
        else:
            write_llada(hf_model, folder)
        return HookedMDM.from_pretrained(str(folder))

    def bridge(self, hf_model: Any) -> Any:
        """A TransformerLens 4.3 `TransformerBridge` around a private copy of the HF model."""
        import logging

        from transformer_lens.model_bridge import TransformerBridge

        folder = self.folder("bridge")
        hf_model.save_pretrained(folder)
        tok = word_tokenizer(hf_model.config.vocab_size, folder)
        logging.getLogger("transformer_lens").setLevel(logging.ERROR)
        private = with_attn(hf_model, "eager")
        return TransformerBridge.boot_transformers(str(folder), hf_model=private, tokenizer=tok, device="cpu",
                                                   dtype=torch.float32)

    def close(self) -> None:
        self._tmp.cleanup()


def random_tokens(size: Size, length: int, seed: int = 1) -> torch.Tensor:
    """Token ids `[1, length]` in `[2, vocab - 1)`: never the mask id, the BOS or the EOS/pad id."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, size.vocab - MASK_OFFSET, (1, length), generator=g)
