"""Read checkpoint tensors lazily, one at a time, from safetensors (single or sharded) or from
PyTorch `.bin` files with `torch.load(weights_only=True)` — never anything that executes code."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open

from mdm_lens.errors import CheckpointError, CheckpointNotFoundError

_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_SINGLES = ("model.safetensors", "pytorch_model.bin")


class CheckpointReader:
    """`keys()`, `shape(key)` and `get(key)` over every weight file of a checkpoint folder."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.files = self._weight_files()
        self._where: dict[str, Path] = {}
        self._bins: dict[Path, dict[str, torch.Tensor]] = {}
        for f in self.files:
            for k in self._file_keys(f):
                self._where[k] = f

    def _weight_files(self) -> list[Path]:
        for index in _INDEXES:
            p = self.folder / index
            if p.exists():
                try:
                    weight_map = json.loads(p.read_text())["weight_map"]
                except (json.JSONDecodeError, KeyError) as e:
                    raise CheckpointError(f"{p} is not a valid shard index ({e}); re-download the checkpoint.") from e
                files = sorted({self.folder / f for f in weight_map.values()})
                missing = [f.name for f in files if not f.exists()]
                if missing:
                    raise CheckpointError(f"{p.name} lists shards that are absent from {self.folder}: {missing}. "
                                          "The download is incomplete; fetch the missing shards.")
                return files
        for single in _SINGLES:
            if (self.folder / single).exists():
                return [self.folder / single]
        found = sorted(set(self.folder.glob("*.safetensors")))
        if found:
            return found
        raise CheckpointNotFoundError(
            f"no weights in {self.folder}: expected model.safetensors, a sharded model.safetensors.index.json, or "
            "pytorch_model.bin. Download the weight files too, e.g. `hf download <repo> --include '*.safetensors' '*.json'`."
        )

    def _file_keys(self, f: Path) -> list[str]:
        if f.suffix == ".safetensors":
            with _open(f) as h:
                return list(h.keys())
        return list(self._bin(f).keys())

    def _bin(self, f: Path) -> dict[str, torch.Tensor]:
        if f not in self._bins:
            try:
                self._bins[f] = torch.load(str(f), map_location="cpu", weights_only=True, mmap=True)
            except Exception as e:  # an unpickler refusal is exactly what weights_only is for
                raise CheckpointError(f"{f} could not be read with torch.load(weights_only=True): {e}. "
                                      "Convert it to safetensors; mdm_lens never unpickles arbitrary objects.") from e
        return self._bins[f]

    def keys(self) -> list[str]:
        return list(self._where)

    def shape(self, key: str) -> tuple[int, ...]:
        f = self._where[key]
        if f.suffix == ".safetensors":
            with _open(f) as h:
                return tuple(h.get_slice(key).get_shape())
        return tuple(self._bin(f)[key].shape)

    def dtype(self, key: str) -> str:
        """The stored dtype's name from the file header ("F32", "BF16", "I32", …; torch's name for a .bin), so a
        wrong dtype is refused before the tensor is read."""
        f = self._where[key]
        if f.suffix == ".safetensors":
            with _open(f) as h:
                return str(h.get_slice(key).get_dtype())
        return str(self._bin(f)[key].dtype).removeprefix("torch.")

    def get(self, key: str) -> torch.Tensor:
        f = self._where[key]
        if f.suffix == ".safetensors":
            with _open(f) as h:
                try:
                    return h.get_tensor(key)
                except Exception as e:  # SafetensorError has no public base class to catch
                    raise _corrupt(f, e, key) from e
        return self._bin(f)[key]


@contextmanager
def _open(f: Path) -> Iterator[Any]:
    """`safe_open`, with an unreadable (truncated, corrupt, not-safetensors) file reported by name."""
    try:
        handle = safe_open(str(f), framework="pt", device="cpu")
    except Exception as e:  # safetensors raises SafetensorError (an Exception subclass) or OSError
        raise _corrupt(f, e) from e
    with handle as h:
        yield h


def _corrupt(f: Path, error: Exception, key: str | None = None) -> CheckpointError:
    size = f.stat().st_size if f.exists() else 0
    what = f" (while reading tensor {key!r})" if key else ""
    return CheckpointError(f"{f} is not a readable safetensors file{what}: {error} [{size} bytes on disk]. The file is "
                           "truncated or corrupt (an interrupted download?); delete it and fetch it again.")


def is_floating_name(name: str) -> bool:
    """A safetensors ("F32", "BF16", "F8_E4M3") or torch ("float32", "bfloat16") dtype name of a real floating type."""
    return name.startswith(("F", "BF")) or name.startswith(("float", "bfloat"))


def refuse_non_floating(reader: Any, keys: Any) -> None:
    """Every weight a model reads is a floating tensor: an integer / bool one (`embed_tokens.weight` saved as
    int32) would be cast silently into nonsense weights, so it is refused by name, as NaN/inf values are."""
    stored = getattr(reader, "stored_name", lambda k: k)  # a renaming view (GIDD's) names the file's own key
    bad = [f"{stored(k)} ({reader.dtype(k)})" for k in keys if not is_floating_name(reader.dtype(k))]
    if bad:
        shown = ", ".join(bad[:6]) + (f" and {len(bad) - 6} more" if len(bad) > 6 else "")
        raise CheckpointError(f"tensor(s) {shown} in {reader.folder} are not floating point: a weight is stored as "
                              "float32 / bfloat16 / float16 (/ float64). The file is corrupt, quantized in a format "
                              "mdm_lens does not read, or not this model's checkpoint.")
