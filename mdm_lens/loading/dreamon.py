"""DreamOn's control tokens, read from a Dream-layout checkpoint's tokenizer files (families-2.md §8).

DreamOn-v0-7B is Dream's architecture (`DreamModel`) with one more control token, `<|expand|>` (151667 in its
tokenizer; `HFTokenizerWrapper.expand_id` of DreamLM/DreamOn@8a0a5491), and "delete" = predicting the
*tokenizer's* EOS inside the span (`eval/generator.py` reads `tokenizer.eos_id`, which is also the EOS that closes
the canvas). When the folder's tokenizer files (`tokenizer.json` added tokens / vocabulary,
`tokenizer_config.json` `added_tokens_decoder`) name `<|expand|>`, its id goes to `cfg.extra["expand_token_id"]`
and the tokenizer's EOS (`eos_token` of tokenizer_config.json / special_tokens_map.json; else `cfg.eos_token_id`)
to `cfg.extra["delete_token_id"]`, so `sampler="dreamon"` runs without cfg.extra edits. A folder without
`<|expand|>` is a plain Dream checkpoint: nothing is added."""

from __future__ import annotations

from pathlib import Path

from mdm_lens import validate
from mdm_lens.config import MDMConfig
from mdm_lens.errors import ConfigError
from mdm_lens.loading.special import TokenTable

EXPAND_TOKEN = "<|expand|>"


def apply_dreamon_tokens(cfg: MDMConfig, folder: Path, family: str) -> None:
    """The expand and delete ids of a DreamOn checkpoint into `cfg.extra` (module docstring), in place."""
    if family != "dream":
        return
    table = TokenTable(folder)
    expand = table.get(EXPAND_TOKEN)
    if expand is None:
        return
    delete, source = table.get(table.eos_name), f"tokenizer files (eos_token {table.eos_name!r})"
    if delete is None:
        delete, source = cfg.eos_token_id, cfg.extra.get("special_token_sources", {}).get("eos_token_id", "unknown")
    for what, i in (("<|expand|>", expand), ("the tokenizer's EOS", delete)):
        if i is not None and not 0 <= i < cfg.d_vocab:
            raise ConfigError(f"{folder}: {what} has id {i}, outside the vocabulary [0, {cfg.d_vocab}) of this "
                              "checkpoint; its tokenizer files and weights disagree.")
    validate.distinct_ids({"mask_token_id": cfg.mask_token_id, "<|expand|>": expand, "the EOS that deletes": delete},
                          error=ConfigError, why=f"{folder}: DreamOn needs three distinct tokens (the same as the "
                          "mask token or the EOS is refused).")
    cfg.extra["expand_token_id"] = expand
    sources = dict(cfg.extra.get("special_token_sources", {}), expand_token_id=f"tokenizer files ({EXPAND_TOKEN!r})")
    if delete is not None:
        cfg.extra["delete_token_id"] = delete
        sources["delete_token_id"] = source
    cfg.extra["special_token_sources"] = sources
