"""Samplers (LLaDA, Dream, autoregressive) run step by step with observable state."""

from mdm_lens.diffusion.arguments import DEFAULT, IdleStepsWarning
from mdm_lens.diffusion.generate import generate
from mdm_lens.diffusion.output import GenerateOutput, Trajectory
from mdm_lens.diffusion.state import DenoisingState

__all__ = ["DEFAULT", "DenoisingState", "GenerateOutput", "IdleStepsWarning", "Trajectory", "generate"]
