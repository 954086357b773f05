"""Sweep folder layout, atomic part files, resume and the rank-0 merge.

    DIR/sweep.json            the arguments that decide the rows (a rerun with others is refused unless --force;
                              a folder with no finished batch is simply reused with the new arguments)
    DIR/parts/plan.json       the units (batches, closed-book units) ever planned here, by number: resuming runs
                              the same units, so a resumed run equals an uninterrupted one; more items (a higher
                              --limit) get new units, numbered after the old ones
    DIR/parts/sampler.json    every distinct sampler ``out.settings`` (seed aside) the runs here used
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

from mdm_lens import validate
from mdm_lens.errors import ArgumentError

__all__ = ["SweepStore"]


class SweepStore:
    def __init__(self, out: str | Path):
        self.root = Path(out)
        self.parts = self.root / "parts"
        self.batch_ids: dict[int, list[str]] | None = None
        self.keep_written = True        # keep what write_batch wrote for merge (the merging rank only)
        self._fresh: dict[int, dict[str, pa.Table]] = {}

    def set_batches(self, batch_ids: list[list[str]] | dict[int, list[str]]) -> None:
        """The item ids of every unit of this run (a list in unit order, or unit number → ids): a unit's
        ``.done`` marker must list exactly them."""
        items = batch_ids.items() if isinstance(batch_ids, dict) else enumerate(batch_ids)
        self.batch_ids = {int(k): list(b) for k, b in items}

    # --- plan ----------------------------------------------------------------------------------------
    def load_plan(self) -> list[tuple[str, list[str]]]:
        """Every unit planned in this folder so far, by number: (kind, item ids); [] in a new folder."""
        path = self.parts / "plan.json"
        if not path.exists():
            return []
        return [(u["kind"], list(u["ids"])) for u in json.loads(path.read_text())["units"]]

    def save_plan(self, plan: list[tuple[str, list[str]]]) -> None:
        _atomic_write(self.parts / "plan.json", json.dumps({"units": [{"kind": k, "ids": ids} for k, ids in plan]}))

    # --- sampler settings ----------------------------------------------------------------------------
    def sampler_settings(self) -> list[dict[str, Any]]:
        path = self.parts / "sampler.json"
        return json.loads(path.read_text()) if path.exists() else []

    def add_sampler_settings(self, seen: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Rank 0: the union of the recorded settings and ``seen`` (kept in first-seen order)."""
        known = self.sampler_settings()
        keys = {json.dumps(s, sort_keys=True, default=str) for s in known}
        for s in seen:
            key = json.dumps(s, sort_keys=True, default=str)
            if key not in keys:
                keys.add(key)
                known.append(json.loads(key))
        _atomic_write(self.parts / "sampler.json", json.dumps(known, indent=1))
        return known

    # --- arguments ---------------------------------------------------------------------------------
    def prepare(self, fingerprint: dict[str, Any], force: bool) -> None:
        """Rank 0: create DIR, or check that DIR was made with the same arguments (``force`` wipes it). A folder
        with no finished batch holds nothing to lose: it is reused with the new arguments, without ``force``
        (a run that failed before computing anything never forces ``--force`` on the next)."""
        validate.output_folder(self.root, name="--out", allowed="a folder (new or a sweep folder)")
        spec = self.root / "sweep.json"
        wipe = force
        if spec.exists():
            old = json.loads(spec.read_text())
            if old != fingerprint:
                if not force and self._any_done():
                    diff = sorted(k for k in set(old) | set(fingerprint) if old.get(k) != fingerprint.get(k))
                    raise ArgumentError(f"{self.root} holds a run made with other arguments (differs in: "
                                        f"{', '.join(diff)}); pass force=True (CLI: --force) to overwrite it, or "
                                        "another out= (CLI: --out).",
                                        argument="out", value=str(self.root))
                wipe = True
        if wipe:
            shutil.rmtree(self.parts, ignore_errors=True)
            for f in self.root.glob("*.parquet"):
                f.unlink()
        (self.root / "manifest.json").unlink(missing_ok=True)     # written again when this run completes
        self.parts.mkdir(parents=True, exist_ok=True)
        for f in self.parts.glob("rank*.json"):     # the last run's per-rank counts (its world size may differ)
            f.unlink()
        _atomic_write(spec, json.dumps(fingerprint, indent=1, sort_keys=True))

    def _any_done(self) -> bool:
        return self.parts.is_dir() and any(self.parts.glob("b*.done"))

    # --- batches -----------------------------------------------------------------------------------
    def done_batches(self) -> set[int]:
        if not self.parts.exists():
            return set()
        done = set()
        for p in self.parts.glob("b*.done"):
            k = int(p.name[1:7])
            if self.batch_ids is None or (k in self.batch_ids and p.read_text().splitlines() == self.batch_ids[k]):
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
            df = _in_schema_dtypes(name, df)
            tmp = self.root / f".{name}.parquet.tmp"
            df.to_parquet(tmp, index=False)
            os.replace(tmp, self.root / f"{name}.parquet")
            tables[name] = df
        return tables

    def write_tables(self, tables: dict[str, pd.DataFrame], suffix: str) -> None:
        for name, df in tables.items():
            df = _in_schema_dtypes(name + suffix, df)
            tmp = self.root / f".{name}{suffix}.parquet.tmp"
            df.to_parquet(tmp, index=False)
            os.replace(tmp, self.root / f"{name}{suffix}.parquet")

    def write_schema(self, names: list[str]) -> None:
        """``schema.json`` / ``schema.md`` beside the tables: each written table's columns, dtypes, units, meaning."""
        from mdm_lens.sweep import schema

        known = [n for n in names if _declared(n)]
        schema.write(self.root, {n: None for n in known})

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


def _declared(name: str) -> bool:
    from mdm_lens.errors import ArgumentError as _Unknown
    from mdm_lens.sweep import schema

    try:
        schema.table_columns(name)
    except _Unknown:
        return False
    return True


def _in_schema_dtypes(name: str, df: pd.DataFrame) -> pd.DataFrame:
    """The declared dtype for every column the schema knows (one dtype per column name across all tables: indices
    and steps `Int64`, ...); a table or column it does not declare is written as it is."""
    from mdm_lens.sweep import schema

    if not _declared(name):
        return df
    known = [c for c in df.columns if c in schema.table_columns(name)]
    return df.assign(**schema.conform(name, df[known])) if known else df
