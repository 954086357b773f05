"""One rule for probe arguments that an option makes meaningless: refuse them, naming both arguments, instead of
returning a result computed without them (``absorption_by_layer(mode="paper", head="each")`` used to return the
head-mean table)."""

from __future__ import annotations

from typing import Any

from mdm_lens import validate
from mdm_lens.errors import ArgumentError


def refuse_ignored(name: str, value: Any, neutral: Any, *, by: str, by_value: Any, why: str) -> None:
    """Raise `ArgumentError` when `name=value` is not its `neutral` value (the one the computation uses anyway)
    while `by=by_value` makes the computation ignore `name`."""
    try:
        same = value is neutral or bool(value == neutral)
    except (TypeError, ValueError, RuntimeError):
        same = False
    if not same:
        raise ArgumentError(f"{name}={validate.describe(value)} is ignored with {by}={by_value!r}: {why}. Pass "
                            f"{name}={neutral!r} (or drop it), or change {by}.", argument=name, value=value,
                            allowed=f"{neutral!r} when {by}={by_value!r}")


def refuse_prompt_length(model: Any, prompt_length: Any, block_diffusion: bool) -> None:
    """`prompt_length` splits a block-diffusion (DiffusionGemma) sequence into encoder and decoder rows; any other
    model's clean forward has one query per position, so a value there would be silently ignored.
    `block_diffusion`: `_runtools.is_block_diffusion(model)` (passed in: this leaf module imports no probe)."""
    if prompt_length is not None and not block_diffusion:
        refuse_ignored("prompt_length", prompt_length, None, by="model", by_value=model.cfg.family,
                       why="only a block-diffusion model (DiffusionGemma) splits its rows at the prompt length")
