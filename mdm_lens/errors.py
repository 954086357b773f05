"""Typed errors. Each message says what went wrong *and* what to do about it."""

from __future__ import annotations


class MDMLensError(Exception):
    """Base class of every error raised on purpose by mdm_lens."""


class ConfigError(MDMLensError, ValueError):
    """A model configuration is inconsistent or unsupported."""


class CheckpointError(MDMLensError, RuntimeError):
    """A checkpoint is malformed: missing/extra tensors, wrong shapes, unreadable files."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The name or path does not resolve to checkpoint files on this machine."""


class UnknownModelError(CheckpointError, KeyError):
    """A name that is neither a local folder nor a known/cached checkpoint."""

    def __str__(self) -> str:  # KeyError would otherwise quote the message
        return str(self.args[0]) if self.args else ""


class HookNameError(MDMLensError, KeyError):
    """A hook name (or filter) that matches no hook point of the model."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class InputError(MDMLensError, ValueError):
    """Bad model input: shapes, dtypes, token ids out of range, padding with the mask id."""


class SamplerConfigError(MDMLensError, ValueError):
    """Sampler settings that cannot work together (checked before any compute)."""


class MemoryBudgetError(MDMLensError, MemoryError):
    """A requested cache would exceed the memory budget."""
