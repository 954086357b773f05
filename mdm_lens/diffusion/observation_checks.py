"""The types of `generate`'s observation arguments (fwd_hooks, record, cache, seed, progress), one check shared by
`generate` and `memory_plan` (a plan accepts what the run would refuse otherwise)."""

from __future__ import annotations

from typing import Any

from mdm_lens import validate
from mdm_lens.errors import ArgumentTypeError


def check_observation(fwd_hooks: Any, record: Any, cache: Any, seed: Any, progress: Any) -> None:
    """Types of the observation arguments (their names and steps are checked by the StepRunner)."""
    from mdm_lens.hooks.reducers import Reducer
    from mdm_lens.hooks.steps import CacheRequest, StepHook
    from mdm_lens.hooks.trajectory import TrajectoryCache

    lone_pair = isinstance(fwd_hooks, tuple) and len(fwd_hooks) == 2 and isinstance(fwd_hooks[0], str)
    if lone_pair or isinstance(fwd_hooks, StepHook) or not isinstance(fwd_hooks, (list, tuple)):
        raise ArgumentTypeError(f"fwd_hooks={validate.describe(fwd_hooks)} must be a list of (name, fn) pairs or "
                                "at_steps(...) hooks; write fwd_hooks=[...].", argument="fwd_hooks", value=fwd_hooks,
                                allowed="a list of (name, fn) pairs or StepHooks")
    validate.instances(list(record) if isinstance(record, tuple) else record, Reducer, name="record")
    ok_cache = cache is None or callable(cache) or isinstance(cache, (str, TrajectoryCache, CacheRequest)) or (
        isinstance(cache, (list, tuple)) and cache and all(isinstance(c, str) for c in cache))
    if not ok_cache:
        raise ArgumentTypeError(f"cache={validate.describe(cache)} must be a TrajectoryCache, a 'name' @ steps(...) "
                                "request, a hook name or a list of hook names.", argument="cache", value=cache,
                                allowed="TrajectoryCache, CacheRequest, str or list of str")
    if seed is not None:
        validate.seed(seed)
    if progress is not None:
        validate.boolean(progress, name="progress")
