"""Argument checks for placement (`from_pretrained(device_map=, max_memory=)`, `model.memory_plan(max_memory=)`).

accelerate parses `max_memory` late and raw (`ValueError: size 1e3 is not in a valid format`, `Device tpu is not
recognized`), and a budget for a device the plan never sees was silently ignored by `memory_plan`. Here every
key and value is checked up front, with an `ArgumentError` naming `max_memory[key]` and the accepted forms:

- keys: a GPU index `N` (or `"cuda:N"`, normalised to `N`, accelerate's spelling), `"cpu"`, `"disk"`, `"mps"`;
  with `real=True` a GPU index must exist on this machine (`torch.cuda.device_count()`);
- values: bytes as an int >= 0, or a size string accelerate parses: a number and one of the units GiB, MiB,
  KiB (powers of 2) or GB, MB, KB (powers of 10; a lowercase final b means bits), e.g. "10GiB", "500MB".

`device_map` also takes a plain device, as transformers does: "cpu", "mps", "cuda", "cuda:1", an int or a
`torch.device` mean `{"": that device}` (the whole model there).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from mdm_lens import validate
from mdm_lens.errors import ArgumentError, ArgumentTypeError

NAMED = ("cpu", "disk", "mps")
SIZE_FORMS = "bytes as an int >= 0, or a size string such as '10GiB', '512MiB', '500MB', '2KB'"
_SIZE = re.compile(r"^\s*\d+(\.\d+)?\s*(GIB|MIB|KIB|GB|MB|KB)$", re.IGNORECASE)
STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


def check_max_memory(max_memory: Any, *, real: bool) -> dict | None:
    """`max_memory` checked (see the module docstring); "cuda:N" keys become N. None stays None."""
    if max_memory is None:
        return None
    if not isinstance(max_memory, dict) or not max_memory:
        raise ArgumentTypeError(f"max_memory={validate.describe(max_memory)} is invalid: expected a non-empty dict "
                                "{device: bytes or '10GiB'} such as {0: '70GiB', 1: '70GiB', 'cpu': '200GiB'}.",
                                argument="max_memory", value=max_memory, allowed="dict {device: bytes}")
    return {_key(k, real): _size(k, v) for k, v in max_memory.items()}


def _key(key: Any, real: bool) -> int | str:
    index = key
    if isinstance(key, str) and re.fullmatch(r"cuda:\d+", key):
        index = int(key.split(":")[1])
    if isinstance(index, int) and not isinstance(index, bool) and index >= 0:
        n = torch.cuda.device_count()
        if real and index >= n:
            raise ArgumentError(f"max_memory[{key!r}] names GPU {index}, and this machine has {n} CUDA device(s): "
                                "its budget would be ignored.", argument=f"max_memory[{key!r}]", value=key,
                                allowed=f"GPU indices 0..{n - 1} or {NAMED}" if n else f"one of {NAMED}")
        return index
    if isinstance(key, str) and key in NAMED:
        return key
    raise ArgumentError(f"max_memory key {key!r} is not a device: expected a GPU index N (or 'cuda:N'), 'cpu', "
                        "'disk' or 'mps'.", argument="max_memory", value=key, allowed=f"int >= 0, 'cuda:N', {NAMED}")


def _size(key: Any, value: Any) -> int | str:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and _SIZE.match(value):
        return value.strip()
    error = ArgumentError if isinstance(value, (str, int)) and not isinstance(value, bool) else ArgumentTypeError
    raise error(f"max_memory[{key!r}]={validate.describe(value)} is invalid: expected {SIZE_FORMS}.",
                argument=f"max_memory[{key!r}]", value=value, allowed=SIZE_FORMS)


def plain_device_map(device_map: Any) -> Any:
    """A plain device given as `device_map` ("cpu", "cuda:1", 0, torch.device) as transformers reads it:
    `{"": device}`. Strategies and dicts pass through unchanged (checked by the planner)."""
    if isinstance(device_map, torch.device):
        return {"": str(device_map)}
    if isinstance(device_map, int) and not isinstance(device_map, bool):
        return {"": device_map}
    if isinstance(device_map, str) and device_map not in STRATEGIES and (
            device_map in ("cpu", "mps") or re.fullmatch(r"cuda(:\d+)?", device_map)):
        return {"": "cuda:0" if device_map == "cuda" else device_map}
    return device_map
