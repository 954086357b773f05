"""Step-indexed hooks, the trajectory cache and streaming reducers."""

from mdm_lens.hooks.memory import estimate_bytes
from mdm_lens.hooks.reducers import KeyValueNorms, ReceivedAttention, Reducer, TopKKeys, received_attention
from mdm_lens.hooks.runner import StepRunner
from mdm_lens.hooks.steps import ALL_STEPS, CacheRequest, StepHook, Steps, at_steps, steps
from mdm_lens.hooks.trajectory import TrajectoryCache

__all__ = ["ALL_STEPS", "CacheRequest", "KeyValueNorms", "ReceivedAttention", "Reducer", "StepHook", "StepRunner",
           "Steps", "TopKKeys", "TrajectoryCache", "at_steps", "estimate_bytes", "received_attention", "steps"]
