"""mdm_lens: TransformerLens-style interpretability for masked diffusion language models."""

from mdm_lens.config import MDMConfig
from mdm_lens.errors import (ArgumentError, ArgumentTypeError, NonFiniteError, OutOfRangeError, CheckpointError, CheckpointNotFoundError, ConfigError, HookNameError, InputError,
                             MDMLensError, MemoryBudgetError, SamplerConfigError, UnknownModelError)
from mdm_lens import validate
from mdm_lens.model import HookedMDM
from mdm_lens.diffusion import DenoisingState, GenerateOutput, Trajectory
from mdm_lens.hooks import (KeyValueNorms, ReceivedAttention, TopKKeys, TrajectoryCache, at_steps,
                            received_attention, steps)

__all__ = ["HookedMDM", "MDMConfig", "DenoisingState", "GenerateOutput", "Trajectory", "KeyValueNorms",
           "ReceivedAttention", "TopKKeys", "TrajectoryCache", "at_steps", "received_attention", "steps", "MDMLensError", "ArgumentError", "ArgumentTypeError", "OutOfRangeError", "NonFiniteError", "ConfigError", "CheckpointError", "CheckpointNotFoundError",
           "UnknownModelError", "HookNameError", "InputError", "SamplerConfigError", "MemoryBudgetError"]
__version__ = "0.1.0"

from mdm_lens.diffusion import IdleStepsWarning  # noqa: E402

__all__ += ["IdleStepsWarning"]

from mdm_lens.lens import LensTrace, TunedLens, answer_emergence, lens_trace, train_tuned_lens  # noqa: E402

__all__ += ["lens_trace", "LensTrace", "TunedLens", "train_tuned_lens", "answer_emergence"]


def __getattr__(name: str):  # `mdm_lens.nnsight` loads on first use: nnsight is an optional extra
    if name == "nnsight":
        import importlib

        return importlib.import_module("mdm_lens.nnsight")
    raise AttributeError(f"module 'mdm_lens' has no attribute {name!r}")
