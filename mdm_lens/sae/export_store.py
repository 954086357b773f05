"""The on-disk side of `export_activations`: one Hugging Face `datasets` shard per batch, and the rank-0
consolidation into SAELens' cached-activation layout.

SAELens' `CacheActivationsRunner` (sae-lens 6.x) saves a `datasets.Dataset` whose rows are token windows:
one column per hook name, `Array2D(shape=(context_size, d_in), dtype)`, and `token_ids`,
`Sequence(Value("int32"), length=context_size)`; its shards are flattened into one folder
(`dataset_info.json`, `state.json`, `data-XXXXX-of-YYYYY.arrow`) that `datasets.load_from_disk` reads, and
`ActivationsStore(use_cached_activations=True)` formats the hook column (and `token_ids`, when present) as
torch, checks `features[hook].shape == (context_size, d_in)` and reads `store_batch_size_prompts` rows at a
time. An export row is one (item, step, position) activation, so `context_size` is 1: the per-row facts
(`item_id`, `step`, `block`, `position`, `is_masked`, `final_token_id`) are plain scalar columns beside
SAELens' two, which its store never reads.

Folder layout (the sweep's `SweepStore` keeps the arguments, the `.done` markers and the rank records):

    DIR/dataset_info.json, DIR/state.json, DIR/data-00000-of-0000N.arrow    the dataset (load_from_disk)
    DIR/cache_activations_runner_cfg.json   SAELens' CacheActivationsRunnerConfig fields for this export
    DIR/sweep.json                          the arguments that decide the rows (a rerun with others is refused)
    DIR/parts/b000012/                      batch 12's shard (save_to_disk), written tmp -> rename
    DIR/parts/b000012.done                  written after it: the batch is complete (its item ids)
    DIR/manifest.json
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from mdm_lens.errors import InputError

__all__ = ["META_COLUMNS", "STORE_DTYPES", "features", "to_dataset", "write_shard", "clear", "consolidate", "saelens_config",
           "require_datasets"]

META_COLUMNS = ("token_ids", "item_id", "step", "block", "position", "is_masked", "final_token_id")
STORE_DTYPES = ("float32", "float16")


def require_datasets() -> Any:
    try:
        import datasets
    except ImportError:  # pragma: no cover - datasets ships with the sae and dev extras
        raise InputError("export_activations writes a Hugging Face `datasets` folder: pip install datasets "
                         "(or mdm-lens[sae]).", argument="out", value=None, allowed="datasets installed") from None
    return datasets


def features(hooks: dict[str, int], store_dtype: str) -> Any:
    """SAELens' features (a `(1, d_in)` Array2D per hook, `token_ids` of length 1) plus the row facts."""
    ds = require_datasets()
    f: dict[str, Any] = {h: ds.Array2D(shape=(1, d), dtype=store_dtype) for h, d in hooks.items()}
    f["token_ids"] = ds.Sequence(ds.Value("int32"), length=1)
    f["item_id"] = ds.Value("string")
    for c in ("step", "block", "position"):
        f[c] = ds.Value("int32")
    f["is_masked"] = ds.Value("bool")
    f["final_token_id"] = ds.Value("int32")
    return ds.Features(f)


def _nested(a: np.ndarray) -> Any:
    """A numpy array [n, d1, ..., dk] as nested Arrow lists over its flat values (no copy per row)."""
    import pyarrow as pa

    values = pa.array(a.reshape(-1))
    for k in range(a.ndim - 1, 0, -1):
        offsets = np.arange(int(np.prod(a.shape[:k])) + 1, dtype=np.int32) * a.shape[k]
        values = pa.ListArray.from_arrays(pa.array(offsets), values)
    return values


def to_dataset(columns: dict[str, Any], feats: Any) -> Any:
    """The rows as a `datasets.Dataset` with ``feats``: the Arrow table `Dataset.from_dict(columns,
    features=feats)` builds (tests/test_sae_export.py checks they are equal), made straight from the numpy
    buffers: `from_dict` walks the activations value by value (~50x slower here)."""
    import pyarrow as pa

    ds = require_datasets()
    schema = feats.arrow_schema
    arrays = []
    for name in schema.names:
        typ, v = schema.field(name).type, columns[name]
        if isinstance(typ, pa.ExtensionType):                      # Array2D: list<list<value>>
            arrays.append(pa.ExtensionArray.from_storage(typ, _nested(np.asarray(v)).cast(typ.storage_type)))
        elif pa.types.is_fixed_size_list(typ):                     # token_ids: Sequence(int32, length=1)
            v = np.asarray(v)
            arrays.append(pa.FixedSizeListArray.from_arrays(pa.array(v.reshape(-1)), v.shape[1]).cast(typ))
        else:
            arrays.append(pa.array(v, type=typ))
    return ds.Dataset(pa.Table.from_arrays(arrays, schema=schema), info=ds.DatasetInfo(features=feats))


def _shard_dir(parts: Path, k: int) -> Path:
    return parts / f"b{k:06d}"


def write_shard(parts: Path, k: int, columns: dict[str, np.ndarray], feats: Any) -> None:
    """Batch k's rows as a saved dataset, written to a temporary folder and renamed into place, so a killed
    run leaves either a whole shard or none (a shard without its `.done` marker is rewritten on resume)."""
    ds = require_datasets()
    table = to_dataset(columns, feats)
    tmp = parts / f".b{k:06d}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    quiet = ds.utils.are_progress_bars_disabled()
    ds.utils.disable_progress_bars()  # one bar per batch would drown the run's own bar
    try:
        table.save_to_disk(str(tmp), num_shards=1)
    finally:
        if not quiet:
            ds.utils.enable_progress_bars()
    final = _shard_dir(parts, k)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)


def _link(src: Path, dst: Path) -> None:
    """A hard link where the file system allows it (no copy of the activations), else a copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def clear(root: Path) -> None:
    """Remove a previous export's dataset files (``force``: the sweep store wipes its parts and arguments)."""
    for name in ("state.json", "dataset_info.json", "manifest.json", "cache_activations_runner_cfg.json"):
        (root / name).unlink(missing_ok=True)
    for old in root.glob("data-*.arrow"):
        old.unlink()


def consolidate(root: Path, parts: Path, batches: list[int]) -> Any:
    """Rank 0: the shards of ``batches``, in batch order, as ONE dataset in ``root`` (as SAELens'
    `_consolidate_shards`: the arrow files are linked, not rewritten). Returns `load_from_disk(root)`."""
    ds = require_datasets()
    for old in root.glob("data-*.arrow"):
        old.unlink()
    files: list[Path] = []
    for k in batches:
        shard = _shard_dir(parts, k)
        state = json.loads((shard / "state.json").read_text())
        files += [shard / f["filename"] for f in state["_data_files"]]
    if not files:
        raise InputError(f"{root}: no exported batch to consolidate.", argument="out", value=str(root),
                         allowed="a folder with done batches")
    names = []
    h = hashlib.sha256()
    for i, src in enumerate(files):
        name = f"data-{i:05d}-of-{len(files):05d}.arrow"
        _link(src, root / name)
        names.append({"filename": name})
        h.update(src.parent.name.encode())
        h.update(str(src.stat().st_size).encode())
    shutil.copy2(_shard_dir(parts, batches[0]) / "dataset_info.json", root / "dataset_info.json")
    state = {"_data_files": names, "_fingerprint": h.hexdigest()[:16], "_format_columns": None,
             "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False, "_split": None}
    tmp = root / f".state.json.tmp{os.getpid()}"
    tmp.write_text(json.dumps(state, indent=2))
    os.replace(tmp, root / "state.json")
    return ds.load_from_disk(str(root))


def saelens_config(*, data: str, model_name: str, batch_size: int, hook: str, d_in: int, n_rows: int,
                   store_dtype: str, seed: int, device: str, out: str) -> dict[str, Any]:
    """The fields of SAELens' `CacheActivationsRunnerConfig` that describe this export (the file its runner
    uploads beside a pushed cache, `cache_activations_runner_cfg.json`): `context_size=1` (one activation
    per row), `training_tokens` the row count, `hook_name` the first hook (the dataset holds a column per
    hook). Not shuffled: rows are in batch order; SAELens' store mixes its buffer when it trains."""
    return dict(dataset_path=data, model_name=model_name, model_batch_size=batch_size, hook_name=hook, d_in=d_in,
                training_tokens=n_rows, context_size=1, model_class_name="HookedMDM",
                new_cached_activations_path=out, shuffle=False, seed=seed, dtype=store_dtype, device=device,
                prepend_bos=True, seqpos_slice=[None], streaming=False)
