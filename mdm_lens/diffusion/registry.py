"""Samplers as plug-ins: one module per sampler declares its settings (a dataclass holding the reference
defaults) and registers a `Sampler`; `generate(model, prompt, sampler=NAME, **settings)` looks it up here,
builds and checks its settings, and hands it the observation arguments. Adding a sampler touches no shared
signature: write the module, call `register(...)` at its end and import it from `mdm_lens.diffusion`.

    @dataclass
    class MySettings(SamplerSettings):
        steps: int | None = None
        threshold: float = 0.9          # the reference default

        def resolve(self, model):       # validate (typed errors) and fill model-dependent values
            ...
            return dataclasses.replace(self, steps=...)

    class MySampler(Sampler):
        name, Settings = "mine", MySettings
        def generate(self, model, prompt, settings, obs): ...
    register(MySampler())
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

from torch import Tensor

from mdm_lens import validate
from mdm_lens.errors import SamplerConfigError


class _Default:
    """The sentinel of an unset argument: the chosen sampler's reference default applies."""

    def __repr__(self) -> str:
        return "DEFAULT"

    def __bool__(self) -> bool:
        return False


DEFAULT: Any = _Default()


@dataclass
class SamplerSettings:
    """Base of every sampler's settings dataclass: its fields are the settings `generate` accepts, their defaults
    the reference's. `resolve(model)` returns the checked, model-resolved copy the sampler runs with."""

    def resolve(self, model: Any) -> "SamplerSettings":
        return self

    def as_dict(self) -> dict[str, Any]:
        """Every effective value, in field order (what `out.settings` shows)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclass
class Observation:
    """What `generate` observes, common to every sampler (checked by `generate` before any compute)."""

    attention_mask: Tensor | None = None
    fwd_hooks: Sequence[Any] = ()
    hook_steps: Any = None
    record: Sequence[Any] = ()
    cache: Any = None
    seed: int | None = 0
    progress: bool | None = None


class Sampler:
    """A registered sampler. Subclasses set `name` and `Settings` and implement `generate`.

    `neutral` maps this sampler's own options to the value under which they do nothing: another sampler accepts
    that value (callers may pass one set of keywords to every sampler) and refuses any other, which it would
    otherwise silently ignore. `renamed` hints at this sampler's name for another sampler's setting."""

    name: ClassVar[str]
    Settings: ClassVar[type[SamplerSettings]]
    neutral: ClassVar[dict[str, Any]] = {}
    renamed: ClassVar[dict[str, str]] = {}

    def check_model(self, model: Any) -> None:
        """Raise SamplerConfigError when this sampler cannot run `model`."""

    def is_neutral(self, option: str, value: Any, given: dict[str, Any]) -> bool:
        if option not in self.neutral:
            return False
        neutral = self.neutral[option]
        return value is neutral or (neutral is not None and value is not None and _equal(value, neutral))

    def settings(self, model: Any, given: dict[str, Any]) -> SamplerSettings:
        """This sampler's settings from `generate`'s keywords: own options kept, another sampler's option at its
        neutral value dropped, anything else refused, then `Settings.resolve(model)`."""
        own = settings_names(self)
        kept: dict[str, Any] = {}
        for option, value in given.items():
            if value is DEFAULT:
                continue
            if option in own:
                kept[option] = value
                continue
            owners = [s for s in _REGISTRY.values() if s is not self and option in settings_names(s)]
            if owners and all(s.is_neutral(option, value, given) for s in owners):
                continue  # does nothing wherever it exists
            raise _foreign(self, option, value, owners)
        return self.Settings(**kept).resolve(model)

    def generate(self, model: Any, prompt: Any, settings: SamplerSettings, obs: Observation) -> Any:
        raise NotImplementedError


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except (TypeError, ValueError, RuntimeError):
        return False


def _foreign(sampler: Sampler, option: str, value: Any, owners: list[Sampler]) -> SamplerConfigError:
    allowed = sorted(settings_names(sampler))
    hint = f" ({option} → {sampler.renamed[option]})" if option in sampler.renamed else ""
    where = ""
    if owners:
        which = " / ".join(repr(s.name) for s in owners)
        where = f": it is a setting of sampler {which}, which the {sampler.name!r} sampler would ignore"
    return SamplerConfigError(f"unknown setting {option}={validate.describe(value)} for sampler {sampler.name!r}"
                              f"{where}{hint}. Its settings: {allowed}.", argument=option, value=value,
                              allowed=", ".join(allowed))


_REGISTRY: dict[str, Sampler] = {}


def register(sampler: Sampler) -> Sampler:
    """Make `sampler` available as `generate(..., sampler=sampler.name)`."""
    if not (dataclasses.is_dataclass(sampler.Settings) and issubclass(sampler.Settings, SamplerSettings)):
        raise TypeError(f"{type(sampler).__name__}.Settings must be a SamplerSettings dataclass")
    _REGISTRY[sampler.name] = sampler
    return sampler


def names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def get(name: Any) -> Sampler:
    return _REGISTRY[validate.choice(name, names(), name="sampler", error=SamplerConfigError)]


def settings_names(sampler: Sampler) -> set[str]:
    """The settings a caller may pass (fields marked `resolved()` are filled by `resolve`, e.g. checkpoint ids)."""
    return {f.name for f in dataclasses.fields(sampler.Settings) if not f.metadata.get("resolved")}


def all_settings() -> set[str]:
    """Every setting name some registered sampler accepts."""
    return set().union(*(settings_names(s) for s in _REGISTRY.values()))


def resolved(default: Any = None) -> Any:
    """A settings field that `resolve` fills from the model (shown on `out.settings`, not an argument)."""
    return dataclasses.field(default=default, metadata={"resolved": True})


def progress_bar(progress: bool | None, total: int, desc: str) -> Any:
    """A tqdm bar when asked (None: when stderr is a terminal)."""
    if progress is None:
        progress = sys.stderr.isatty()
    if not progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="step", leave=False)
