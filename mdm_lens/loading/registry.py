"""Known checkpoints and the facts that their `config.json` does not carry (mask ids, special tokens).

Values come from `shared/specs/architectures.md` (§2.4, §4.1, §11)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class KnownModel:
    name: str
    family: str  # llada | dream | llama | qwen2 | mdm_lens
    mask_token_id: int | None
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    special: dict[str, int] = field(default_factory=dict)
    twin: str | None = None  # the autoregressive (or diffusion) twin used for comparisons
    zoo: bool = False  # shipped inside the package (mdm_lens/zoo/assets/<folder>)
    notes: str = ""


_LLADA_SPECIAL = {"<|startoftext|>": 126080, "<|endoftext|>": 126081, "<|mdm_mask|>": 126336,
                  "<|start_header_id|>": 126346, "<|end_header_id|>": 126347, "<|eot_id|>": 126348}
_DREAM_SPECIAL = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
                  "<|beginoftext|>": 151665, "<|mask|>": 151666}
_LLAMA_SPECIAL = {"<|begin_of_text|>": 128000, "<|end_of_text|>": 128001, "<|eot_id|>": 128009}
_QWEN_SPECIAL = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}


def _llada(name: str, notes: str = "") -> KnownModel:
    return KnownModel(name, "llada", 126336, 126080, 126081, 126081, _LLADA_SPECIAL,
                      twin="meta-llama/Meta-Llama-3-8B-Instruct", notes=notes)


def _dream(name: str) -> KnownModel:
    return KnownModel(name, "dream", 151666, None, 151643, 151643, _DREAM_SPECIAL, twin="Qwen/Qwen2.5-7B-Instruct",
                      notes="logits shifted by one (hidden i-1 predicts token i)")


KNOWN_MODELS: dict[str, KnownModel] = {m.name: m for m in [
    _llada("GSAI-ML/LLaDA-8B-Base"),
    _llada("GSAI-ML/LLaDA-8B-Instruct"),
    _llada("GSAI-ML/LLaDA-1.5", notes="VRPO-aligned LLaDA-8B-Instruct, same architecture"),
    _dream("Dream-org/Dream-v0-Base-7B"),
    _dream("Dream-org/Dream-v0-Instruct-7B"),
    KnownModel("meta-llama/Meta-Llama-3-8B", "llama", None, 128000, 128001, None, _LLAMA_SPECIAL,
               twin="GSAI-ML/LLaDA-8B-Base"),
    KnownModel("meta-llama/Meta-Llama-3-8B-Instruct", "llama", None, 128000, 128009, None, _LLAMA_SPECIAL,
               twin="GSAI-ML/LLaDA-8B-Instruct"),
    KnownModel("Qwen/Qwen2.5-7B", "qwen2", None, None, 151643, 151643, _QWEN_SPECIAL, twin="Dream-org/Dream-v0-Base-7B"),
    KnownModel("Qwen/Qwen2.5-7B-Instruct", "qwen2", None, None, 151645, 151643, _QWEN_SPECIAL,
               twin="Dream-org/Dream-v0-Instruct-7B"),
    KnownModel("mdm-lens/tiny-mdm", "mdm_lens", 3, 1, 2, 0, zoo=True, twin="mdm-lens/tiny-arm",
               notes="shipped tiny masked diffusion twin (see mdm_lens/zoo)"),
    KnownModel("mdm-lens/tiny-arm", "mdm_lens", 3, 1, 2, 0, zoo=True, twin="mdm-lens/tiny-mdm",
               notes="shipped tiny autoregressive twin (see mdm_lens/zoo)"),
]}

# Family defaults for ids config.json lacks, when the folder is not in the registry (EOS and end-of-turn
# ids are read from the checkpoint's own files first: see loading/special.py).
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llada": dict(mask_token_id=126336, bos_token_id=126080, pad_token_id=126081),
    "dream": dict(mask_token_id=151666, bos_token_id=None, pad_token_id=151643),
    "llama": dict(mask_token_id=None),
    "qwen2": dict(mask_token_id=None),
}


def lookup(name: str) -> KnownModel | None:
    if name in KNOWN_MODELS:
        return KNOWN_MODELS[name]
    lowered = {k.lower(): v for k, v in KNOWN_MODELS.items()}
    return lowered.get(name.lower())
