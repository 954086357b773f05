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


class ArgumentError(MDMLensError, ValueError):
    """An argument of a public function is invalid. Raised by `mdm_lens.validate`, whose messages name the
    argument, the value given and what is allowed; `argument`, `value` and `allowed` are also attributes."""

    def __init__(self, message: str, *, argument: str | None = None, value: object = None,
                 allowed: str | None = None) -> None:
        super().__init__(message)
        self.argument, self.value, self.allowed = argument, value, allowed


class ArgumentTypeError(ArgumentError, TypeError):
    """An argument of the wrong type (``steps=4.5``, ``record=ReceivedAttention()`` not in a list)."""


class OutOfRangeError(ArgumentError, IndexError):
    """An index (layer, head, step, position) outside its range; negative indices count from the end."""


class NonFiniteError(ArgumentError):
    """NaN or inf in a tensor or statistic where a probe needs finite numbers."""


class InputError(ArgumentError):
    """Bad model input: shapes, dtypes, token ids out of range, padding with the mask id."""


class SamplerConfigError(ArgumentError):
    """Sampler settings that cannot work together (checked before any compute)."""


class SamplerConfigTypeError(SamplerConfigError, ArgumentTypeError):
    """A sampler setting of the wrong type (`stability_threshold=2.5`, `confidence_threshold="0.5"`): a sampler
    configuration error and a type error both, so either `except` catches it."""


class StepForwardError(SamplerConfigError):
    """A run's step ran no forward that one plain forward of its canvas reproduces (a window read through a KV cache
    filled by earlier forwards): probes that patch or differentiate that forward refuse the step, saying why."""


class MemoryBudgetError(MDMLensError, MemoryError):
    """A requested cache would exceed the memory budget."""


class InputTypeError(InputError, ArgumentTypeError):
    """Model input of the wrong type (text where token ids are expected, float token ids, a non-tensor mask)."""


class ReadOnlyViewError(MDMLensError, RuntimeError):
    """An in-place write into a weight view that is a copy (a stack over layers, a repeated GQA head, a zero
    bias the checkpoint does not have): the write would be silently lost, so it is refused."""


class UnknownLengthError(MDMLensError, RuntimeError):
    """A fact about a run that is decided only after the step asking for it: `DenoisingState.is_last` during a
    run whose length is known only at its end (adaptive commits or stopping)."""


class OffloadedWeightsError(ArgumentError, RuntimeError):
    """A weight view, weight processing or save on a model whose device_map offloaded some modules (to disk, or
    to CPU memory behind an accelerator): their weights sit on the `meta` device outside a forward, so a read
    would fail inside torch and a write (or a fold) would be lost. Names the offloaded modules."""


class UnsupportedAttributeError(ArgumentError, AttributeError):
    """A TransformerLens attribute or method this model class does not define, and why (the DDiT models' adaLN gate
    and σ-modulated readout: `mdm_lens.ddit.unsupported`). An `AttributeError` too, so `hasattr` and
    `getattr(model, name, default)` behave as for any missing attribute."""
