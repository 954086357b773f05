"""LLaDA2.2 on top of the LLaDA2.x loader (families-2.md §10): what can be read, and what is refused.

Known: LLaDA2.2 keeps `LLaDA2MoeModelLM` / `llada2_moe` and adds two edit-control tokens, DELETE and INSERT
(SPLIT), which SGLang's InDel sampler reads from the HF config as `delete_token_id` / `split_token_id` (sglang
@7c7e7941; LLaDA2.2-flash's public config lacked them then). Those two are read here into
`cfg.extra["delete_token_id"]` / `cfg.extra["split_token_id"]` (checked in the vocabulary).

Unknown (the hub `modeling_llada2_moe.py` of LLaDA2.2 was not readable): the config keys of *block routing* (the
admission pool of C experts per diffusion block, and whether the prompt's prefill routes by block) and of the 128K
context (RoPE scaling). A checkpoint that says it is LLaDA2.2 — its name, or a key naming block routing or
admission — is refused with an error that names those missing facts, rather than loaded with token-wise routing
(a silently different model)."""

from __future__ import annotations

import re
from typing import Any

from mdm_lens import validate
from mdm_lens.config import MDMConfig
from mdm_lens.errors import ConfigError

EDIT_KEYS = ("delete_token_id", "split_token_id")
_ROUTING_KEY = re.compile(r"block_?rout|admission|admit|expert_pool|routing_block", re.IGNORECASE)
_NAME = re.compile(r"llada[-_ ]?2[._]2", re.IGNORECASE)

MISSING_FACTS = ("the config key names of block routing (admission pool size C of E routed experts, the diffusion "
                 "block it pools over, and whether the prompt / prefill routes by block), and the RoPE / context "
                 "settings of the 128K context")


def check_llada22(config: dict[str, Any], name: str) -> None:
    """Refuse a LLaDA2.2 checkpoint (module docstring): its forward differs in facts not published."""
    routing = sorted(k for k in config if _ROUTING_KEY.search(str(k)))
    names = [str(v) for v in (name, config.get("_name_or_path"), config.get("name_or_path")) if v]
    if routing or any(_NAME.search(n) for n in names):
        why = f"config.json keys {routing}" if routing else f"the name {next(n for n in names if _NAME.search(n))!r}"
        raise ConfigError(f"{why} mark a LLaDA2.2 checkpoint, whose forward routes experts per diffusion block; "
                          f"mdm_lens does not load it, because these facts are not known: {MISSING_FACTS} "
                          "(families-2.md §10; needs LLaDA2.2's hub modeling_llada2_moe.py). Loading it with "
                          "LLaDA2.0's token-wise routing would be a different model. The InDel sampler runs on "
                          "LLaDA2.x checkpoints whose config has delete_token_id and split_token_id.")


def apply_edit_tokens(cfg: MDMConfig, config: dict[str, Any]) -> None:
    """`delete_token_id` / `split_token_id` from config.json into `cfg.extra` (both or neither)."""
    given = {k: config[k] for k in EDIT_KEYS if config.get(k) is not None}
    if not given:
        return
    if len(given) == 1:
        (key,) = given
        other = [k for k in EDIT_KEYS if k != key][0]
        raise ConfigError(f"config.json has {key}={given[key]!r} but no {other}: LLaDA2.2's InDel decoding needs "
                          "both edit tokens (DELETE and SPLIT).")
    for key, value in given.items():
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < cfg.d_vocab:
            raise ConfigError(f"config.json has {key}={value!r}: expected a token id in [0, {cfg.d_vocab}).")
    validate.distinct_ids({**given, "mask_token_id": cfg.mask_token_id}, error=ConfigError,
                          why="config.json edit tokens must differ from each other and from the mask token.")
    cfg.extra.update(given)
