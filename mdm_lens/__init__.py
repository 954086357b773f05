"""mdm_lens: TransformerLens-style interpretability for masked diffusion language models."""

from mdm_lens.config import MDMConfig
from mdm_lens.errors import (CheckpointError, CheckpointNotFoundError, ConfigError, HookNameError, InputError,
                             MDMLensError, MemoryBudgetError, SamplerConfigError, UnknownModelError)
from mdm_lens.model import HookedMDM

__all__ = ["HookedMDM", "MDMConfig", "MDMLensError", "ConfigError", "CheckpointError", "CheckpointNotFoundError",
           "UnknownModelError", "HookNameError", "InputError", "SamplerConfigError", "MemoryBudgetError"]
__version__ = "0.1.0"
