"""Special-token ids (EOS, end-of-turn) read from the checkpoint folder itself.

The samplers need two ids: EOS (`cfg.eos_token_id`; LLaDA's `logits_eos_inf`, ARM stopping) and the
end-of-turn token (`cfg.extra["eot_token_id"]`; LLaDA's `confidence_eos_eot_inf` suppresses `<|eot_id|>`).
They are read, in this order, from the folder's `config.json`, `generation_config.json`,
`tokenizer_config.json`, `special_tokens_map.json` and `tokenizer.json`; only when the folder says nothing
do the registry (a known hub id) and then the family's reference constant (LLaDA's `generate.py` hard-codes
126081 and 126348) fill in, and an id outside the vocabulary is never used. Each id's origin is kept in
`cfg.extra["special_token_sources"]`; an id nobody knows stays None and the sampler option that needs it
raises instead of silently skipping.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mdm_lens.config import MDMConfig
from mdm_lens.errors import ConfigError

# End-of-turn token names, most specific first: Llama-3 / LLaDA chat, then Qwen / Dream chat.
EOT_NAMES = ("<|eot_id|>", "<|im_end|>")
# Reference constants of the samplers (used only for a checkpoint whose files name no such token).
FAMILY_EOS = {"llada": 126081, "nemotron_dllm": 2}  # Nemotron: NemotronLabsDiffusionConfig's eos default
FAMILY_EOT = {"llada": 126348}


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON ({e}); re-download it or delete it.") from e
    return data if isinstance(data, dict) else {}


def _token_name(value: Any) -> str | None:
    """`"<|endoftext|>"` or the AddedToken dict `{"content": "<|endoftext|>", ...}`."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _first_int(value: Any) -> int | None:
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class TokenTable:
    """Token name → id from the tokenizer files of a folder (added tokens first, then the vocabulary)."""

    def __init__(self, folder: Path):
        self.ids: dict[str, int] = {}
        tok_cfg = _read_json(folder / "tokenizer_config.json")
        for key, entry in (tok_cfg.get("added_tokens_decoder") or {}).items():
            name = _token_name(entry)
            if name is not None and str(key).isdigit():
                self.ids.setdefault(name, int(key))
        tok = _read_json(folder / "tokenizer.json")
        for entry in tok.get("added_tokens") or []:
            if isinstance(entry, dict) and isinstance(entry.get("content"), str) and isinstance(entry.get("id"), int):
                self.ids.setdefault(entry["content"], entry["id"])
        vocab = (tok.get("model") or {}).get("vocab")
        if isinstance(vocab, dict):
            for name, i in vocab.items():
                if isinstance(i, int):
                    self.ids.setdefault(name, i)
        self.eos_name = _token_name(tok_cfg.get("eos_token")) or _token_name(
            _read_json(folder / "special_tokens_map.json").get("eos_token"))

    def get(self, name: str | None) -> int | None:
        return None if name is None else self.ids.get(name)


def _checkpoint_eos(folder: Path, raw_config: dict[str, Any], table: TokenTable) -> tuple[int | None, str, list[int]]:
    gen = _read_json(folder / "generation_config.json")
    for source, value in (("config.json", raw_config.get("eos_token_id")),
                          ("generation_config.json", gen.get("eos_token_id"))):
        first = _first_int(value)
        if first is not None:
            ids = [v for v in value if isinstance(v, int)] if isinstance(value, list) else [first]
            return first, source, ids
    i = table.get(table.eos_name)
    if i is not None:
        return i, f"tokenizer files (eos_token {table.eos_name!r})", [i]
    return None, "", []


def apply_special_tokens(cfg: MDMConfig, folder: Path, raw_config: dict[str, Any], family: str,
                         known: Any = None) -> None:
    """Fill `cfg.eos_token_id`, `cfg.extra["eot_token_id"]` (int or None) and their sources, in place."""
    table = TokenTable(folder)
    eos, source, all_eos = _checkpoint_eos(folder, raw_config, table)
    if eos is None and known is not None and known.eos_token_id is not None:
        eos, source, all_eos = known.eos_token_id, f"registry entry {known.name}", [known.eos_token_id]
    if eos is None and family in FAMILY_EOS:
        eos, source, all_eos = FAMILY_EOS[family], f"{family} reference sampler constant", [FAMILY_EOS[family]]
    eot, eot_source = _first_int((raw_config.get("extra") or {}).get("eot_token_id")), ""
    if eot is not None:  # our own format keeps the id it was given
        eot_source = "config.json (extra.eot_token_id)"
    for name in EOT_NAMES if eot is None else ():
        if table.get(name) is not None:
            eot, eot_source = table.get(name), f"tokenizer files ({name!r})"
            break
    if eot is None and known is not None:
        for name in EOT_NAMES:
            if name in known.special:
                eot, eot_source = known.special[name], f"registry entry {known.name} ({name!r})"
                break
    if eot is None and family in FAMILY_EOT:
        eot, eot_source = FAMILY_EOT[family], f"{family} reference sampler constant"
    eos, source = _in_vocab(cfg, "eos_token_id", eos, source)
    eot, eot_source = _in_vocab(cfg, "eot_token_id", eot, eot_source)
    cfg.eos_token_id = eos
    cfg.extra["eot_token_id"] = eot
    cfg.extra["eos_token_ids"] = [i for i in all_eos if 0 <= i < cfg.d_vocab] if eos is not None else []
    cfg.extra["special_token_sources"] = {"eos_token_id": source or "unknown",
                                           "eot_token_id": eot_source or "unknown"}


def _in_vocab(cfg: MDMConfig, what: str, value: int | None, source: str) -> tuple[int | None, str]:
    """An id the embedding cannot hold: an error if the checkpoint's own files say it, dropped if it was a
    fallback (a registry or reference constant for a bigger vocabulary than this checkpoint's)."""
    if value is None or 0 <= value < cfg.d_vocab:
        return value, source
    if source.startswith(("config.json", "generation_config.json", "tokenizer")):
        raise ConfigError(f"{what}={value} from {source} is outside the vocabulary [0, {cfg.d_vocab}) of this "
                          "checkpoint; its files disagree with each other.")
    return None, ""
