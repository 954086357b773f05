"""Samplers (LLaDA, Dream, autoregressive, DiffusionGemma, ...) run step by step with observable state; each is a
plug-in of `mdm_lens.diffusion.registry` declaring its settings with the reference defaults."""

from mdm_lens.diffusion.arguments import DEFAULT, IdleStepsWarning, MaskedAnswerWarning
from mdm_lens.diffusion.generate import generate, plan
from mdm_lens.diffusion.output import GenerateOutput, Trajectory
from mdm_lens.diffusion.registry import Sampler, SamplerSettings, register
from mdm_lens.diffusion.state import DenoisingState

__all__ = ["DEFAULT", "DenoisingState", "GenerateOutput", "IdleStepsWarning", "MaskedAnswerWarning", "Sampler", "SamplerSettings",
           "Trajectory", "generate", "plan", "register"]
