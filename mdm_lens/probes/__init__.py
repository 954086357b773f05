"""Probes: tensor-level metrics over attention patterns, received attention and q/k/v vectors.

- :mod:`floating` — received attention, anchor (floating token / sink) detection, absorption with
  uniform nulls, drift across denoising steps, fixed-sink vs floating labels (spec §3.1–§3.5);
- :mod:`qk` — exact norm/angle (Shapley) split of an anchor key's QK advantage (§3.6);
- :mod:`flow` — regions, token-level rollout, pooled region flow and its diagnostics (§3.8).

Every result is a dataclass with ``.to_frame()`` (tidy long-format DataFrame).
"""

from . import flow, floating, qk
from ._results import ResultMixin

__all__ = ["floating", "qk", "flow", "ResultMixin"]
