"""`mdm-lens report DIR`: the HTML report of one or more sweep folders (figures, tables, and per section the
comparisons the numbers support). DIR is a sweep folder (it has ``manifest.json``) or a folder whose
subfolders are sweeps; several sweeps (e.g. an MDM and its ARM twin) are drawn side by side. The demo is a
sweep plus this report.

What the report promises: every comparison carries n and a 95% bootstrap interval over items, and a claim
("X helps most", "the angle term carries the advantage") appears only when its interval lies off 0 with the
stated sign, else the sentence says tie (:mod:`mdm_lens.views.stats`); every model is in every section or the
section says why it is not; the folders it left out are listed with the reason.

Sections come from a registry, in order: :func:`register_section` adds one (e.g. from another module)::

    register_section("lens", my_section, tables=("lens",), after="qk")

A section maker takes ``(sweeps, img)`` (the sweeps that have its tables and are not skipped, and the figure
folder) and returns a :class:`~mdm_lens.views.report.Section` or None.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import pandas as pd
import pyarrow.parquet as pq

from mdm_lens import validate
from mdm_lens.errors import ArgumentError, InputError
from mdm_lens.sweep import schema
from mdm_lens.views import sweep_layers, sweep_sections
from mdm_lens.views.explore_report import explorer_section
from mdm_lens.views.fig_atp import TITLE as ATP_TITLE, atp_section
from mdm_lens.views.fig_cache import cache_section, cache_skip
from mdm_lens.views.fig_lens import lens_section
from mdm_lens.views.fig_probes import probes_section
from mdm_lens.views.report import Section, write_report

__all__ = ["report", "load_sweeps", "find_sweeps", "Sweep", "sections", "SectionSpec", "SECTIONS",
           "register_section"]


class Sweep:
    """The sweep folder(s) of one model, data file and settings: manifests and lazily read tables (the first folder
    holding a table provides it, so e.g. a knockout sweep on fewer items can sit beside the main one). Tables are
    read with the dtypes of :mod:`mdm_lens.sweep.schema` (columns it does not know are kept as they are)."""

    def __init__(self, roots: Sequence[Path]):
        self.roots = [Path(r) for r in roots]
        self.manifests = [json.loads((r / "manifest.json").read_text()) for r in self.roots]
        self.manifest = self.manifests[0]
        self.model = self.manifest["model"]["id"]
        self.label = self.model.split("/")[-1]
        self.causal = self.manifest["model"].get("family") in ("llama", "qwen2") or "arm" in self.label
        self._cache: dict[str, pd.DataFrame | None] = {}

    def table(self, name: str) -> pd.DataFrame | None:
        if name not in self._cache:
            found = [r / f"{name}.parquet" for r in self.roots if (r / f"{name}.parquet").exists()]
            self._cache[name] = _read(name, found[0]) if found else None
        return self._cache[name]

    @property
    def n_items(self) -> int:
        return max(int(m["items_done"]) for m in self.manifests)

    @property
    def probes(self) -> list[str]:
        return list(dict.fromkeys(p for m in self.manifests for p in m.get("arguments", {}).get("probes", [])))


def _unreadable(shown: str, e: Exception) -> str:
    first = str(e).splitlines()[0][:200] if str(e) else ""
    return (f"{shown} is not a readable table ({type(e).__name__}: {first}); rerun the sweep into a fresh folder, "
            "or remove the file")


def _no_value(name: str, columns: Sequence[str]) -> bool:
    """True when table ``name`` should have a ``value`` column (every section reads it) and has none."""
    try:
        known = schema.table_columns(name)
    except ArgumentError:            # a table this version does not describe: as it is
        return False
    return "value" in known and "value" not in columns


def _read(name: str, path: Path) -> pd.DataFrame:
    try:
        df = pd.read_parquet(path)
    except Exception as e:  # pyarrow's errors share no public base class: a truncated or foreign file
        raise InputError(f"{_unreadable(str(path), e)}.", argument="folder", value=str(path),
                         allowed="a finished sweep's tables") from None
    if _no_value(name, df.columns):  # name the table, not a KeyError
        raise InputError(f"{path} has no 'value' column (columns: {list(df.columns)}): not a table this sweep "
                         "wrote.", argument="folder", value=str(path), allowed="a finished sweep's tables")
    try:
        known = schema.table_columns(name)
    except ArgumentError:            # a table this version does not describe: as it is
        return df
    cols = [c for c in df.columns if c in known]
    try:
        return df if not cols else df.assign(**schema.conform(name, df[cols]))
    except (TypeError, ValueError):  # e.g. a fractional value in an index column of an older table: as it is
        return df


def _why_not_a_sweep(p: Path) -> str | None:
    """Why folder ``p`` is left out, or None when it is a finished sweep."""
    man = p / "manifest.json"
    if not man.exists():
        return ("unfinished: sweep.json but no manifest.json (the merge never ran; rerun the sweep to resume it)"
                if (p / "sweep.json").exists() else None)
    try:
        m = json.loads(man.read_text())
        m["model"]["id"]
        done = int(m["items_done"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"manifest.json unreadable ({type(e).__name__}: {e})"
    if done == 0:
        return "no items done (0 in manifest.json)"
    return _bad_table(p)


def _bad_table(p: Path) -> str | None:
    """Why one of the tables of sweep folder ``p`` cannot be read, or None. Every table is checked here, from its
    footer and schema only, because a table is read lazily from the first folder holding it: a damaged copy in a
    later folder of the same sweep would otherwise never be read, and so never reported."""
    for f in sorted(p.glob("*.parquet")):
        try:
            columns = pq.read_schema(f).names
        except Exception as e:  # pyarrow's errors share no public base class: a truncated or foreign file
            return _unreadable(f.name, e)
        if _no_value(f.stem, columns):
            return f"{f.name} has no 'value' column (columns: {columns}): not a table this sweep wrote"
    return None


# manifest ``arguments`` that do not decide a folder's rows: other probes (or the same probe again) complement a
# sweep; the model id and the data's hash are the group key already (the data's path may differ); the batch size
# and how items are cut into units decide no row when batching is "length" (rows bit-identical to the item alone)
_NOT_ROWS = ("probes", "model", "data", "data_hash")
_LENGTH_ONLY = ("batch_size", "layout")


def _settings(man: dict) -> dict[str, Any]:
    """The resolved settings of a sweep folder that decide its rows (``arguments`` less :data:`_NOT_ROWS`)."""
    args = man.get("arguments", {})
    args = args if isinstance(args, dict) else {}
    drop = _NOT_ROWS + (_LENGTH_ONLY if args.get("batching", "length") == "length" else ())
    return {k: v for k, v in args.items() if k not in drop}


def find_sweeps(folder: str | Path, exclude: Sequence[Path] = ()) -> tuple[list[Sweep], list[tuple[str, str]]]:
    """The sweeps in ``folder`` (itself, or its subfolders) in first-seen order, and the subfolders left out with
    the reason: (name, why). Subfolders are one sweep when they share the model, the data file and the resolved
    settings (manifest ``arguments`` but the probes); a folder whose table cannot be read is left out (``folder``
    itself: an error). Subfolders with neither ``sweep.json`` nor ``manifest.json`` (a report, figures) are not
    sweeps and are not listed."""
    folder = Path(folder)
    if not folder.is_dir():  # a typo in the path is not a missing sweep
        what = "is a file, not a folder" if folder.exists() else "does not exist"
        raise InputError(f"{folder} {what}: give a sweep folder (the --out of `mdm-lens sweep`) or a folder of "
                         "them.", argument="folder", value=str(folder), allowed="an existing sweep folder")
    if (folder / "manifest.json").exists():
        why = _why_not_a_sweep(folder)
        if why:
            raise InputError(f"{folder} is not a usable sweep: {why}.", argument="folder", value=str(folder),
                             allowed="a finished sweep folder with readable tables")
        return [Sweep([folder])], []
    skip = {Path(e).resolve() for e in exclude}
    subs = [p for p in sorted(folder.iterdir()) if p.is_dir() and p.resolve() not in skip] if folder.is_dir() else []
    roots, left = [], []
    for p in subs:
        why = _why_not_a_sweep(p)
        if why:
            left.append((p.name, why))
        elif (p / "manifest.json").exists():
            roots.append(p)
    if not roots:
        detail = "; ".join(f"{n}: {w}" for n, w in left)
        raise InputError(f"{folder} is not a sweep folder (no manifest.json) and has no finished sweep subfolders"
                         + (f" (left out: {detail})" if detail else "") + "; run `mdm-lens sweep ... --out DIR` "
                         "first.", argument="folder", value=str(folder))
    # one Sweep per (model, data, settings): only folders of one model on one data file run with the same resolved
    # settings complement each other (other probes, a knockout sweep on fewer items, resume pieces); the same
    # model on other data or with other settings (steps, seed, dtype ...) is another sweep, labelled by its folders
    # and the settings that differ, never mixed
    groups: dict[tuple[str, str, str], list[Path]] = {}
    settings: dict[tuple[str, str, str], dict[str, Any]] = {}
    for r in roots:
        man = json.loads((r / "manifest.json").read_text())
        data = man.get("arguments", {}).get("data_hash") or str(man.get("data", {}).get("path", ""))
        rows = _settings(man)
        key = (man["model"]["id"], data, json.dumps(rows, sort_keys=True, default=str))
        groups.setdefault(key, []).append(r)
        settings[key] = rows
    sweeps = [Sweep(rs) for rs in groups.values()]
    for key, sw in zip(groups, sweeps):
        mine = [settings[k] for k in groups if k[0] == key[0]]
        if len(mine) > 1:
            names = sorted({n for rows in mine for n in rows})
            # a setting an older manifest does not record is told apart by the folder names alone
            differ = [n for n in names if len({json.dumps(rows[n], default=str) for rows in mine if n in rows}) > 1]
            shown = ", ".join(f"{n} {settings[key][n]}" for n in differ if n in settings[key])
            sw.label = f"{sw.label} ({', '.join(r.name for r in sw.roots)}{'; ' + shown if shown else ''})"
    return sweeps, left


def load_sweeps(folder: str | Path) -> list[Sweep]:
    """The sweeps in ``folder`` (see :func:`find_sweeps`), without the list of left-out folders."""
    return find_sweeps(folder)[0]


# --- the section registry --------------------------------------------------------------------------

@dataclass(frozen=True)
class SectionSpec:
    """A report section: ``make(sweeps, img)``; ``tables``: a sweep is in it when it has any of them;
    ``skip(sweep)``: a reason to leave a sweep out although it has the table (None: keep it)."""

    key: str
    make: Callable[[Sequence[Sweep], Path], Section | None]
    tables: tuple[str, ...]
    skip: Callable[[Sweep], str | None] | None = None
    title: str = ""             # shown when every sweep with the table is skipped (the section then says why)


SECTIONS: list[SectionSpec] = []


def register_section(key: str, make: Callable[[Sequence[Any], Path], Section | None], tables: Sequence[str],
                     skip: Callable[[Any], str | None] | None = None, after: str | None = None,
                     title: str | None = None) -> SectionSpec:
    """Add (or replace, by ``key``) a section; ``after``: the key it follows (default: last); ``title``: the
    section's title when every sweep that has its tables is skipped (default: the key)."""
    if not isinstance(key, str) or not key:
        raise ArgumentError(f"key={key!r} is not a section name: expected a non-empty str.", argument="key",
                            value=key, allowed="a non-empty str")
    if not callable(make):
        raise ArgumentError(f"make={make!r} is not callable: expected f(sweeps, img) -> Section | None.",
                            argument="make", value=make, allowed="a callable")
    spec = SectionSpec(key, make, tuple(validate.instances(tables, str, name="tables", allow_single=True)), skip,
                       title or key)
    keys = [s.key for s in SECTIONS]
    if key in keys:
        SECTIONS[keys.index(key)] = spec
        return spec
    if after is not None:
        validate.choice(after, keys, name="after")
        SECTIONS.insert(keys.index(after) + 1, spec)
    else:
        SECTIONS.append(spec)
    return spec


# probes whose table file carries the probe's own name (the report's sections read them)
TABLE_PROBES = ("absorption", "qk", "retrieval", "flow", "knockout", "lens", "cache", "features", "accuracy", "atp")


def _absent(spec: SectionSpec, s: Sweep) -> str | None:
    """Why sweep ``s`` is not in section ``spec``, or None."""
    have = [t for t in spec.tables if s.table(t) is not None]
    if not have:
        listed = [t for t in spec.tables if t in s.probes]
        if listed:  # the manifest says the probe ran: a missing file is a broken / partial copy, not "no result"
            return (f"{s.label}: {listed[0]}.parquet is missing from its sweep folder(s) although the manifest lists "
                    f"the {listed[0]} probe (a partial copy?)")
        return (f"{s.label}: no {' / '.join(spec.tables)} table in its sweep folder(s) (probes run: "
                f"{', '.join(s.probes) or 'none recorded'})")
    if all(not len(s.table(t)) for t in have):
        return f"{s.label}: its {' / '.join(have)} table has no rows"
    why = spec.skip(s) if spec.skip is not None else None
    return f"{s.label}: {why}" if why else None


def sections(sweeps: Sequence[Sweep], img: Path) -> list[Section]:
    """The registered sections that have at least one sweep, each saying which models it leaves out and why."""
    out = []
    for spec in SECTIONS:
        why = {s.label: _absent(spec, s) for s in sweeps}
        present = [s for s in sweeps if why[s.label] is None]
        if not present:
            # a table on disk (even empty) or a probe the manifest lists, with no sweep shown: say why, never drop
            if any(any(s.table(t) is not None for t in spec.tables) for s in sweeps) \
                    or any(t in s.probes for s in sweeps for t in spec.tables):
                out.append(Section(spec.title, absent=[w for w in why.values() if w]))   # skipped, say why
            continue
        sec = spec.make(present, img)
        if sec is not None:
            out.append(replace(sec, absent=list(sec.absent) + [w for w in why.values() if w]))
    return out


def _canvas(sweeps: Sequence[Sweep]) -> str:
    per = {s.label: f"gen_length {s.manifest['arguments'].get('gen_length')}, steps "
                    f"{s.manifest['arguments'].get('steps')}" for s in sweeps}
    return next(iter(per.values())) if len(set(per.values())) == 1 else "; ".join(f"{k}: {v}" for k, v in per.items())


def report(folder: str | Path, out: str | Path | None = None, title: str | None = None,
           extra: Sequence[Section] = (), meta: dict[str, Any] | None = None) -> Path:
    """Write ``out/index.html`` (default ``folder/report``) from the sweep(s) in ``folder``; returns its path."""
    out = validate.output_folder(out if out is not None else Path(folder) / "report", name="out")
    sweeps, left = find_sweeps(folder, exclude=[out])
    img = out / "figures"
    img.mkdir(parents=True, exist_ok=True)
    secs = sections(sweeps, img) + list(extra)
    missing = [f"{s.label}: {p}.parquet (listed in the manifest, not in the folder)" for s in sweeps for p in s.probes
               if p in TABLE_PROBES and s.table(p) is None]
    left_out = [f"{n}: {w}" for n, w in left] + missing
    info = {"sweeps": ", ".join(f"{s.label} ({s.n_items} items)" for s in sweeps),
            "left out": "; ".join(left_out) if left_out else "none",
            "probes": ", ".join(dict.fromkeys(p for s in sweeps for p in s.probes)),
            "canvas": _canvas(sweeps), **(meta or {})}
    return write_report(out, title or "mdm_lens sweep report: " + " vs ".join(s.label for s in sweeps), secs, info)


for _spec in sweep_layers.BUILTIN + sweep_sections.BUILTIN:      # accuracy … knockout, in this order
    register_section(**_spec)
register_section("lens", lens_section, tables=("lens",), title="Logit lens over denoising steps")
register_section("features", probes_section, tables=("features",), title="Linear probes over layer × step")
register_section("cache", cache_section, tables=("cache",), skip=cache_skip, title="KV-cache staleness")
register_section("explorer", explorer_section, tables=("temporal_keys",), after="temporal", title="Step explorer")
register_section("atp", atp_section, tables=("atp",), title=ATP_TITLE)
