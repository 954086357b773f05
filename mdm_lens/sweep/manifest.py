"""``manifest.json``: what a sweep ran, not only what was asked.

* ``arguments``: the settings that decide the rows, as resolved (the model's real dtype, the steps the sampler
  takes, the template ``auto`` chose), the same object as ``sweep.json``; ``asked``: the call's own arguments.
* ``ran``: the device and dtype of the weights, the world size, and every distinct sampler ``out.settings``
  (seed aside: it is per item) of the sampler calls made in this folder, recorded by :class:`SamplerLog`.
* ``skipped`` / ``warnings``: why items were left out (also ``skipped.parquet``) and what the tables' reader
  should know (passages not shown).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import platform
import time
from typing import Any

import pandas as pd
import torch

from mdm_lens.noisy import notes_for

__all__ = ["SamplerLog", "config_hash", "file_hash", "versions", "model_dtype", "model_device", "build"]

_CAP = 1000    # list entries kept in the manifest (the tables hold all)


class SamplerLog:
    """Records ``out.settings`` of every ``model.generate`` call made while active (the batched runs and the
    probes' own calls all go through it); the model is restored on exit, even when the run raises."""

    def __init__(self, model: Any):
        self.model, self.seen, self._keys = model, [], set()

    def __enter__(self) -> "SamplerLog":
        inner = self.model.generate

        def generate(*args: Any, **kwargs: Any) -> Any:
            out = inner(*args, **kwargs)
            settings = {k: v for k, v in dict(getattr(out, "settings", {}) or {}).items() if k != "seed"}
            entry = json.loads(json.dumps({"sampler": getattr(out, "sampler", None), **settings}, sort_keys=True,
                                          default=str))
            key = json.dumps(entry, sort_keys=True)
            if key not in self._keys:
                self._keys.add(key)
                self.seen.append(entry)
            return out

        self._had = "generate" in vars(self.model)
        self._old = vars(self.model).get("generate")
        object.__setattr__(self.model, "generate", generate)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._had:
            object.__setattr__(self.model, "generate", self._old)
        else:
            object.__delattr__(self.model, "generate")


def config_hash(model: Any) -> str:
    cfg = dataclasses.asdict(model.cfg) if dataclasses.is_dataclass(model.cfg) else dict(vars(model.cfg))
    cfg.pop("dtype", None)
    return hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()[:16]


def file_hash(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def versions() -> dict[str, str]:
    import numpy
    import pyarrow

    import mdm_lens
    return {"mdm_lens": getattr(mdm_lens, "__version__", "?"), "torch": torch.__version__, "pandas": pd.__version__,
            "pyarrow": pyarrow.__version__, "numpy": numpy.__version__, "python": platform.python_version()}


def _first_parameter(model: Any) -> torch.Tensor | None:
    try:
        return next(iter(model.parameters()))
    except (AttributeError, StopIteration, TypeError):
        return None


def model_dtype(model: Any) -> str:
    """The dtype the weights are in (``float32``, ``bfloat16`` ...)."""
    p = _first_parameter(model)
    return "unknown" if p is None else str(p.dtype).removeprefix("torch.")


def model_device(model: Any) -> str:
    dev = getattr(model, "input_device", None)
    if dev is None:
        p = _first_parameter(model)
        dev = "cpu" if p is None else p.device
    return str(dev)


def build(*, fingerprint: dict, asked: dict, read: Any, n_selected: int, done: list[str], skipped: list[dict],
          warnings: list[dict], ranks: list[dict], sampler: list[dict], model: Any, world_size: int,
          tables: dict[str, pd.DataFrame], wall: float) -> dict:
    return {
        "arguments": fingerprint,
        "asked": asked,
        "ran": {"device": model_device(model), "dtype": model_dtype(model), "world_size": world_size,
                "devices": sorted({r.get("device", "?") for r in ranks}), "sampler": sampler},
        "versions": versions(),
        "model": {"id": model.cfg.model_name, "family": model.cfg.family, "config_sha256_16": fingerprint["config_hash"],
                  "n_layers": model.cfg.n_layers, "n_heads": model.cfg.n_heads,
                  "notes": notes_for(model.cfg)},  # e.g. what "masked" means on a uniform-state model (Duo)
        "template": fingerprint["template"],
        "data": {"path": asked["data"], "lines_read": len(read.items) + len(read.skipped), "items": len(read.items),
                 "selected": n_selected},
        "items_done": len(done),
        "items_skipped": len(skipped),
        "skipped": skipped[:_CAP],
        "n_warnings": len(warnings),
        "warnings": warnings[:_CAP],
        "world_size": world_size,
        "ranks": ranks,
        "tables": {name: len(df) for name, df in tables.items()},
        "wall_s": round(wall, 3),
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
