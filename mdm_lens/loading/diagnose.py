"""Why a checkpoint's tensors and its config.json disagree, in words that name the config key.

`build_state_dict` refuses a checkpoint whose tensor names are not the ones the weight plan expects. A long list
of names ("720 missing tensors") hides the cause: usually one config value, such as an expert count the file does
not set (so the reference default applies) or a layer count. `mismatch_report` names every missing and
unexpected tensor (the full lists go to a text file when they are too long to read inline) and, first, the
config keys whose values the tensor names contradict."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Any

INLINE = 40  # names listed in the message itself; longer lists are written to a file
# the config.json key each family reads for its expert count and its layer count
EXPERT_KEYS = {"llada2_moe": "num_experts", "lladamoe": "num_experts",
               "sdar_moe": "num_experts (or its alias num_local_experts)"}
LAYER_KEYS = {"llada": "n_layers", "mdm_lens": "n_layers"}
_EXPERT = re.compile(r"\.experts\.(\d+)\.")
_LAYER = re.compile(r"(?:^|\.)(?:layers|blocks)\.(\d+)\.")


def _indices(pattern: re.Pattern[str], names: list[str]) -> set[int]:
    return {int(m.group(1)) for m in map(pattern.search, names) if m}


def _count_hint(what: str, key: str, given: int, present: set[int], raw: dict[str, Any]) -> str:
    if not present or max(present) + 1 == given:
        return ""
    names = [w.strip("()") for w in key.replace(",", " ").split() if w.strip("()").isidentifier() and "_" in w]
    origin = "" if any(n in raw for n in names) else " (absent from config.json: the reference default)"
    return (f"config.json's {key} gives {given} {what}{origin}, but the checkpoint holds {what} "
            f"{min(present)}..{max(present)} ({max(present) + 1}); set {key.split(' ')[0]} to match the weights. ")


def causes(cfg: Any, family: str, raw: dict[str, Any], keys: list[str]) -> str:
    """The config keys whose values the checkpoint's tensor names contradict ('' when none is evident)."""
    hints = _count_hint("layers", LAYER_KEYS.get(family, "num_hidden_layers"), cfg.n_layers, _indices(_LAYER, keys),
                        raw)
    moe = cfg.extra.get("moe")
    if moe and family in EXPERT_KEYS:
        hints += _count_hint("experts", EXPERT_KEYS[family], int(moe["n_experts"]), _indices(_EXPERT, keys), raw)
    return hints


def listing(what: str, names: list[str], folder: Path) -> str:
    """`N what tensor(s) [every name]`, or the first names and the file that holds all of them."""
    if len(names) <= INLINE:
        return f"{len(names)} {what} tensor(s) {names}"
    with tempfile.NamedTemporaryFile("w", prefix=f"mdm_lens_{what}_", suffix=".txt", delete=False) as f:
        f.write(f"# {what} tensors of the checkpoint at {folder}\n" + "\n".join(names) + "\n")
    return f"{len(names)} {what} tensor(s) (all listed in {f.name}; the first {INLINE}: {names[:INLINE]})"


def mismatch_report(folder: Path, missing: list[str], extra: list[str], hint: str) -> str:
    return (f"checkpoint at {folder} does not match its config: {hint}{listing('missing', missing, folder)}; "
            f"{listing('unexpected', extra, folder)}. Check that config.json belongs to these weights.")
