"""Reading a checkpoint folder's config.json (a leaf module: every loader, HookedMDM's and HookedDDiT's, reads
the file through it without importing the loaders)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mdm_lens.errors import CheckpointNotFoundError, ConfigError


def read_config_json(folder: Path) -> dict[str, Any]:
    """A checkpoint folder's config.json as a dict: a missing file, bad JSON (or not UTF-8) and a JSON value
    that is not an object are typed errors naming the file, for every loader (HookedMDM's and HookedDDiT's)."""
    path = Path(folder) / "config.json"
    if not path.exists():
        raise CheckpointNotFoundError(f"{folder} has no config.json; it is not a checkpoint folder.")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {e}.") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} holds a {type(raw).__name__}, not a JSON object of settings.")
    return raw
