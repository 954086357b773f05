"""Samplers (LLaDA, Dream, autoregressive) run step by step with observable state."""

from mdm_lens.diffusion.generate import generate
from mdm_lens.diffusion.output import GenerateOutput, Trajectory
from mdm_lens.diffusion.state import DenoisingState

__all__ = ["DenoisingState", "GenerateOutput", "Trajectory", "generate"]
