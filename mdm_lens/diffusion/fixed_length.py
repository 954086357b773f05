"""The refusal every consumer that reads canvas column j as one position across steps gives a variable-length run
(DreamOn's expand / delete, LLaDA2.2's InDel: `mdm_lens.diffusion.varlen`). A module of its own, importing only
the errors, so that views and probes can call it without tying themselves to the samplers' output types."""

from __future__ import annotations

from typing import Any

from mdm_lens.errors import SamplerConfigError


def require_fixed_length(out: Any, what: str, would: str = "") -> None:
    """Refuse a variable-length run where a consumer assumes canvas column j is one position at every step;
    `would` says what the consumer would do with positions that did not exist at a step."""
    trace = getattr(getattr(out, "trajectory", None), "length", None)
    if trace is None:
        return
    widths = sorted(set(trace.widths.tolist()))
    changed = trace.n_slots > trace.n_original or bool((trace.removed_how != 0).any())
    how = (f"inserted and deleted rows mid-run (canvas widths {widths[:6]}{' …' if len(widths) > 6 else ''})"
           if changed else f"is variable-length: its steps are laid out by slot, and although this run happened to "
           f"insert and delete nothing (canvas width {widths[0]} throughout), consumers do not special-case it")
    raise _refusal(what, out.sampler, how, would, "out")


def refuse_variable_sampler(kwargs: dict, what: str, would: str = "") -> None:
    """Before any compute: a consumer that runs `generate` itself with the caller's `sampler=` refuses a sampler
    that inserts and deletes rows (DreamOn, InDel), with the same typed error as `require_fixed_length`."""
    name = kwargs.get("sampler")
    if not isinstance(name, str):
        return
    from mdm_lens.diffusion import registry

    if name in registry.names() and getattr(registry.get(name), "variable_length", False):
        raise _refusal(what, name, "would insert and delete rows mid-run", would, "sampler")


def _refusal(what: str, sampler: str, how: str, would: str, argument: str) -> SamplerConfigError:
    return SamplerConfigError(
        f"{what} reads canvas column j as one position across steps, but this {sampler!r} run {how}"
        f"{': ' + would if would else ''}. Positions that did not exist at a step have no value there. Map "
        "columns to original positions with out.trajectory.length.origin_steps (−1: inserted), or use a "
        "fixed-length sampler.", argument=argument, value=sampler, allowed="a fixed-length run")
