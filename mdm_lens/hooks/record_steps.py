"""The denoising steps of a record's rows, checked against the record itself.

Readers (`probes.run`, `views.explore`, `probes.retrieval`) map a step to a row of a record through
`record_meta[name]["steps"]`; a list whose length differs from the record's step axis (a reducer instance that
was reused across runs before reducers reset per run, or a hand-edited meta) would index the wrong row silently
or crash inside torch, so it is refused here, naming the record."""

from __future__ import annotations

from typing import Any

from mdm_lens.errors import InputError


def record_steps(out: Any, name: str, n_rows: int, allow_empty: bool = False) -> list[int]:
    """The run step of each of the `n_rows` rows of record `name` of `out` (its meta's "steps"; `range(n_rows)`
    when the record lists none). Raises InputError when the list does not have one distinct step per row, and when
    the record has no row at all (unless `allow_empty`), saying why (`empty_reason`)."""
    meta = getattr(out, "record_meta", {}).get(name, {})
    if n_rows == 0 and not allow_empty:
        raise InputError(empty_reason(out, name), argument="out", value=name, allowed="a record with step rows")
    if "steps" not in meta:
        return list(range(n_rows))
    listed = [int(s) for s in meta["steps"]]
    if len(listed) != n_rows or len(set(listed)) != len(listed):
        raise InputError(
            f"record {name!r} has {n_rows} step row(s) but its record_meta lists steps {listed}: the rows cannot be "
            "matched to steps. Record with a fresh run (each generate call's meta lists its own steps).",
            argument="out", value=listed, allowed=f"{n_rows} distinct steps")
    return listed


def empty_reason(out: Any, name: str) -> str:
    """Why record `name` of `out` has no step row: its scheduled steps ran no forward (MDLM `ddpm_cache` / BD3LM
    steps that reused an earlier step's p(x0): `record_meta[name]["no_forward"]`), or none of them ran."""
    meta = getattr(out, "record_meta", {}).get(name, {})
    skipped = meta.get("no_forward")
    if skipped:
        return (f"record {name!r} has no step rows: its scheduled step(s) {skipped} reused the cache (no forward: the "
                f"{getattr(out, 'sampler', 'sampler')!r} sampler sampled again from an earlier step's p(x0), the canvas "
                "unchanged), so there was nothing to record. Schedule the reducer on steps that ran a forward (an "
                "all-steps record lists them in record_meta[...]['steps']).")
    return (f"record {name!r} has no step rows: none of its scheduled steps ran in this run "
            f"(record_meta[{name!r}]['steps'] == []).")
