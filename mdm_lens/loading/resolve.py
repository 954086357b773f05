"""Where a checkpoint lives (a zoo name, a local folder, a hub id in the HF cache) and its tokenizer file.

The lowest layer of loading: both the native loader (`mdm_lens.loading`) and the transformers bridge
(`mdm_lens.bridge.loading`) resolve names and read tokenizers here, so neither imports the other for it.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any

from mdm_lens import validate
from mdm_lens.errors import ArgumentError, CheckpointError, CheckpointNotFoundError, UnknownModelError
from mdm_lens.loading.registry import KNOWN_MODELS, KnownModel, lookup

__all__ = ["resolve", "load_tokenizer", "ZOO_DIR", "ZOO_ORG"]

ZOO_DIR = Path(__file__).resolve().parent.parent / "zoo" / "assets"
ZOO_ORG = "mdm-lens"
_ALLOW = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]


def _did_you_mean(text: str) -> str:
    close = difflib.get_close_matches(text.lower(), [k.lower() for k in KNOWN_MODELS], n=1, cutoff=0.6)
    if not close and "/" not in text:  # "tiny-mdm" for "mdm-lens/tiny-mdm": compare with the part after the org
        tails = {k.split("/")[-1].lower(): k for k in KNOWN_MODELS}
        close = [tails[c].lower() for c in difflib.get_close_matches(text.lower(), list(tails), n=1, cutoff=0.6)]
    if not close:
        return ""
    name = next(k for k in KNOWN_MODELS if k.lower() == close[0])
    return f" Did you mean {name}?"


def resolve(name_or_path: str | os.PathLike, allow_download: bool = False) -> tuple[Path, KnownModel | None]:
    """The local folder holding the checkpoint, and its registry entry if it is a known model."""
    text = str(name_or_path)
    if not text.strip():
        raise ArgumentError("name_or_path='' is invalid: expected a checkpoint folder, a hub id (org/name) or a "
                            f"zoo name ({', '.join(k for k, v in KNOWN_MODELS.items() if v.zoo)}).",
                            argument="name_or_path", value=name_or_path, allowed="a folder, hub id or zoo name")
    known = lookup(text)
    if known is not None and known.zoo:
        folder = ZOO_DIR / known.name.split("/")[-1]
        if not (folder / "config.json").exists():
            raise CheckpointNotFoundError(f"the zoo model {known.name} is not in this installation ({folder}). "
                                          "Rebuild it with `python -m mdm_lens.zoo.train`.")
        return folder, known
    path = Path(text).expanduser()
    if validate.path_kind(path, name="name_or_path") == "dir":
        return path, known
    if text.lower().startswith(ZOO_ORG + "/"):  # our own org never lives on the hub: a typo of a zoo name
        zoo = ", ".join(k for k, v in KNOWN_MODELS.items() if v.zoo)
        raise UnknownModelError(f"unknown zoo model {text!r}.{_did_you_mean(text) or ''} The shipped models are: "
                                f"{zoo}.")
    if text.startswith((".", "/", "~")) or os.sep in text.strip("/").replace("/", "", 1):
        raise CheckpointNotFoundError(f"no folder at {path}. Pass an existing checkpoint folder or a hub id.")
    if "/" not in text:
        raise UnknownModelError(f"unknown model {text!r}: not a folder and not a hub id (org/name).{_did_you_mean(text)}"
                                f" Known models: {', '.join(KNOWN_MODELS)}.")
    try:
        return _from_hf_cache(text, allow_download), known
    except CheckpointNotFoundError as e:
        hint = "" if known is not None else _did_you_mean(text)
        if hint:
            raise CheckpointNotFoundError(f"{e}{hint}") from e
        raise


def _from_hf_cache(repo_id: str, allow_download: bool) -> Path:
    from huggingface_hub import snapshot_download

    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
    # read the cache location now, not at huggingface_hub's import, so a changed HF_HUB_CACHE is honoured
    cache_dir = os.environ.get("HF_HUB_CACHE") or (
        os.path.join(os.environ["HF_HOME"], "hub") if os.environ.get("HF_HOME") else None)
    try:
        return Path(snapshot_download(repo_id, local_files_only=True, allow_patterns=_ALLOW, cache_dir=cache_dir))
    except Exception as cached_error:  # LocalEntryNotFoundError and friends
        if allow_download and not offline:
            return Path(snapshot_download(repo_id, allow_patterns=_ALLOW, cache_dir=cache_dir))
        why = "HF_HUB_OFFLINE is set" if offline else "downloads are off by default (allow_download=False)"
        raise CheckpointNotFoundError(
            f"{repo_id} is not in the Hugging Face cache ({type(cached_error).__name__}) and {why}. Fetch it once "
            f"with `hf download {repo_id} --include '*.json' '*.safetensors' 'tokenizer*'` (or "
            "`huggingface-cli download …`), or pass the local folder that holds config.json and the weights."
        ) from cached_error


def load_tokenizer(folder: Path) -> Any:
    """A tokenizer from the folder's files, without remote code; None when the folder has none."""
    if (folder / "tokenizer.json").exists():
        from tokenizers import Tokenizer

        try:
            return Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as e:  # tokenizers raises a bare Exception for a malformed file
            raise CheckpointError(f"{folder / 'tokenizer.json'} could not be read ({e}); fetch it again, or pass "
                                  "load_tokenizer=False to load the weights without it.") from e
    return None
