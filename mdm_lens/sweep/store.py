"""Sweep folder layout, atomic part files, resume and the rank-0 merge.

    DIR/sweep.json            the arguments that decide the rows (a rerun with others is refused unless --force)
    DIR/parts/b000012.{table}.parquet   rows of batch 12, one file per table, written tmp → rename
    DIR/parts/b000012.done    written last: the batch is complete (its item ids, one per line)
    DIR/parts/rank{r}.json    per-rank counts and wall time of the last run
    DIR/{table}.parquet       merged rows (all done batches, in data order)
    DIR/{table}_summary.parquet
    DIR/manifest.json

A batch counts only once its ``.done`` marker exists and lists the batch's item ids (``set_batches``); parts
without one (a run killed mid-batch, or a folder cut into other batches by an older version) are recomputed
and overwritten, so a killed run never loses or duplicates rows.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from mdm_lens.errors import ArgumentError

__all__ = ["SweepStore"]


class SweepStore:
    def __init__(self, out: str | Path):
        self.root = Path(out)
        self.parts = self.root / "parts"
        self.batch_ids: list[list[str]] | None = None
        self.keep_written = True        # keep what write_batch wrote for merge (the merging rank only)
        self._fresh: dict[int, dict[str, pa.Table]] = {}

    def set_batches(self, batch_ids: list[list[str]]) -> None:
        """The item ids of every batch of this run, in batch order: a ``.done`` marker must list them."""
        self.batch_ids = [list(b) for b in batch_ids]

    # --- arguments ---------------------------------------------------------------------------------
    def prepare(self, fingerprint: dict[str, Any], force: bool) -> None:
        """Rank 0: create DIR, or check that DIR was made with the same arguments (``force`` wipes it)."""
        spec = self.root / "sweep.json"
        if spec.exists():
            old = json.loads(spec.read_text())
            if old != fingerprint:
                if not force:
                    diff = sorted(k for k in set(old) | set(fingerprint) if old.get(k) != fingerprint.get(k))
                    raise ArgumentError(f"{self.root} holds a sweep made with other arguments (differs in: "
                                        f"{', '.join(diff)}); use --force to overwrite it, or another --out.",
                                        argument="out", value=str(self.root))
            if force:
                shutil.rmtree(self.parts, ignore_errors=True)
                for f in self.root.glob("*.parquet"):
                    f.unlink()
        self.parts.mkdir(parents=True, exist_ok=True)
        _atomic_write(spec, json.dumps(fingerprint, indent=1, sort_keys=True))

    # --- batches -----------------------------------------------------------------------------------
    def done_batches(self) -> set[int]:
        if not self.parts.exists():
            return set()
        done = set()
        for p in self.parts.glob("b*.done"):
            k = int(p.name[1:7])
            if self.batch_ids is None or (k < len(self.batch_ids) and p.read_text().splitlines() == self.batch_ids[k]):
                done.add(k)
        return done

    def write_batch(self, k: int, tables: dict[str, pd.DataFrame], item_ids: list[str]) -> None:
        fresh = {}
        for name, df in tables.items():
            tmp = self.parts / f".b{k:06d}.{name}.parquet.tmp{os.getpid()}"
            table = pa.Table.from_pandas(df, preserve_index=False)
            pq.write_table(table, tmp)
            os.replace(tmp, self.parts / f"b{k:06d}.{name}.parquet")
            fresh[name] = table
        _atomic_write(self.parts / f"b{k:06d}.done", "\n".join(item_ids) + "\n")
        if self.keep_written:
            self._fresh[k] = fresh

    def _part(self, k: int, name: str, path: Path) -> pd.DataFrame:
        """Batch k's rows of table ``name``: the Arrow table this process wrote (no re-read), else the file."""
        table = self._fresh.get(k, {}).pop(name, None)
        if table is None or _to_pandas is None:
            return pd.read_parquet(path)
        return _to_pandas(table)            # what pd.read_parquet does with the table it reads

    def done_items(self, batches: Any = None) -> list[str]:
        """Item ids of the done batches (of ``batches`` only, when given)."""
        ids = []
        keep = None if batches is None else set(batches)
        for k in sorted(b for b in self.done_batches() if keep is None or b in keep):
            ids += (self.parts / f"b{k:06d}.done").read_text().split()
        return ids

    def write_rank(self, rank: int, info: dict[str, Any]) -> None:
        _atomic_write(self.parts / f"rank{rank}.json", json.dumps(info, indent=1))

    def rank_infos(self) -> list[dict[str, Any]]:
        return [json.loads(p.read_text()) for p in sorted(self.parts.glob("rank*.json"))]

    # --- merge -------------------------------------------------------------------------------------
    def merge(self, batches: list[int], order: dict[str, int]) -> dict[str, pd.DataFrame]:
        """Concatenate the parts of ``batches`` (done ones only) → DIR/{table}.parquet, rows in data order of
        their items (``order``: item id → index; stable within an item), the same for any world size."""
        done = self.done_batches()
        names: dict[str, list[tuple[int, Path]]] = {}
        for k in sorted(b for b in batches if b in done):
            for p in sorted(self.parts.glob(f"b{k:06d}.*.parquet")):
                names.setdefault(p.name.split(".")[1], []).append((k, p))
        tables = {}
        for name, paths in names.items():
            frames = [self._part(k, name, p) for k, p in paths]
            df = pd.concat([f for f in frames if len(f)], ignore_index=True) if any(len(f) for f in frames) else frames[0]
            if len(df):
                rank = df["item_id"].map(order)
                df = df.iloc[rank.to_numpy().argsort(kind="stable")].reset_index(drop=True)
            tmp = self.root / f".{name}.parquet.tmp"
            df.to_parquet(tmp, index=False)
            os.replace(tmp, self.root / f"{name}.parquet")
            tables[name] = df
        return tables

    def write_tables(self, tables: dict[str, pd.DataFrame], suffix: str) -> None:
        for name, df in tables.items():
            tmp = self.root / f".{name}{suffix}.parquet.tmp"
            df.to_parquet(tmp, index=False)
            os.replace(tmp, self.root / f"{name}{suffix}.parquet")

    def write_manifest(self, manifest: dict[str, Any]) -> None:
        _atomic_write(self.root / "manifest.json", json.dumps(manifest, indent=1, default=str))


try:  # pandas' own Arrow → DataFrame step of read_parquet (same dtypes); without it, parts are re-read
    from pandas.io._util import arrow_table_to_pandas as _to_pandas
except ImportError:  # pragma: no cover
    _to_pandas = None


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
