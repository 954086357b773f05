"""The sweep's two plain records, below both ``adapter`` (which runs the probes) and ``tables`` (which builds
their rows): ``Settings`` (what every probe call of a sweep shares) and ``Batch`` (left-padded prompts of
rendered items). They live here so ``tables`` need not import ``adapter``, which imports ``tables``."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from mdm_lens.sweep.templates import Rendered

__all__ = ["Settings", "Batch"]


@dataclass(frozen=True)
class Settings:
    gen_length: int
    steps: int
    block_length: int | None
    keep_keys: int = 1          # items (by data order) whose per-key temporal rows are kept (for heatmaps)
    n_random: int = 2           # knockout random-control draws
    exact: bool = True          # never pad: prompts of other lengths run as separate sampler calls


@dataclass
class Batch:
    rendered: list[Rendered]
    nocontext: list[Rendered] | None
    ids: Tensor                 # [batch, pos] left-padded
    attention_mask: Tensor
    offsets: list[int]          # left pads per row
    item_ids: list[str]
    seeds: list[int]
    order: list[int]            # data-order index of each item
