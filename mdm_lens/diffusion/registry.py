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
from mdm_lens.diffusion.family_check import check_family
from mdm_lens.diffusion.rules import Rule, check_given, undeclared
from mdm_lens.errors import ArgumentError, ArgumentTypeError, SamplerConfigError


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
    the reference's. `rules` declares each caller-settable field's valid values and the option that activates it
    (mdm_lens.diffusion.rules); the registry applies them before `resolve(model)`, which returns the checked,
    model-resolved copy the sampler runs with."""

    rules: ClassVar[dict[str, Rule]] = {}

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
    otherwise silently ignore. `renamed` hints at this sampler's name for another sampler's setting; `absent` says why
    this sampler has no such setting (BD3LM's block is config.json's block_size), for the refusal of another
    sampler's setting."""

    name: ClassVar[str]
    Settings: ClassVar[type[SamplerSettings]]
    neutral: ClassVar[dict[str, Any]] = {}
    renamed: ClassVar[dict[str, str]] = {}
    absent: ClassVar[dict[str, str]] = {}
    # why `out.replay` / `state_at` cannot rebuild this sampler's forwards ("" = they can): refused with it, rather
    # than replaying a different forward
    no_replay: ClassVar[str] = ""

    def check_model(self, model: Any) -> None:
        """Raise SamplerConfigError when this sampler cannot run `model`."""

    def is_neutral(self, option: str, value: Any, given: dict[str, Any]) -> bool:
        if option not in self.neutral:
            return False
        neutral = self.neutral[option]
        return value is neutral or (neutral is not None and value is not None and _equal(value, neutral))

    def settings(self, model: Any, given: dict[str, Any]) -> SamplerSettings:
        """This sampler's settings from `generate`'s keywords: first the sampler against the model's family
        (`family_check`: a sampler on a family it was not written for is refused), then own options kept, another
        sampler's option at its neutral value dropped, anything else refused, then `Settings.resolve(model)`."""
        check_family(self, model, _REGISTRY.values())  # before anything reads the model's config
        own = settings_names(self)
        kept: dict[str, Any] = {}
        for option, value in given.items():
            if value is DEFAULT:
                continue
            if option in own:
                kept[option] = value
                continue
            if option in resolved_names(self):
                raise SamplerConfigError(f"{option}={validate.describe(value)}: sampler {self.name!r} reads {option} "
                                         "from the checkpoint (model.cfg; shown on out.settings), not from a keyword; "
                                         "set it on model.cfg to change it.", argument=option, value=value,
                                         allowed="not a keyword (set on model.cfg)")
            owners = [s for s in _REGISTRY.values() if s is not self and option in settings_names(s)]
            if owners and all(s.is_neutral(option, value, given) for s in owners):
                continue  # does nothing wherever it exists
            raise _foreign(self, option, value, owners)
        settings = self.Settings(**kept)
        check_given(self.name, settings, kept)  # ranges and inert options, the same rule for every sampler
        try:
            return settings.resolve(model)
        except ArgumentError as e:
            raise unpassed(self, e, kept) from None

    def forward_extents(self, settings: SamplerSettings, prompt_length: int) -> list[tuple[int, int, int, int]] | None:
        """(query rows, key positions, KV-cache positions held, rows whose logits the sampler processes) of each kind
        of forward the run makes, for `memory_plan`; None: one forward over the canvas (prompt + gen_length), every
        row sampled, with a cache where the settings ask for one."""
        return None

    def run_extent(self, settings: SamplerSettings, batch: int, prompt_length: int) -> tuple[int, int]:
        """(forwards, canvas width) the run sizes its step-bound caches and records for (`StepRunner.begin`):
        `memory_plan`'s requested caches use the same numbers. Default: `steps` (else one per answer token) over
        the prompt and the answer."""
        gen = self.answer_length(settings)
        return int(getattr(settings, "steps", None) or gen), prompt_length + gen

    @staticmethod
    def answer_length(settings: SamplerSettings) -> int:
        """The tokens the run generates: `gen_length`, or `max_new_tokens` where a sampler keeps the reference's
        name (Fast-dLLM v2)."""
        return int(getattr(settings, "gen_length", None) or getattr(settings, "max_new_tokens", None) or 0)

    def trajectory_bytes(self, settings: SamplerSettings, batch: int, prompt_length: int, steps: int) -> int:
        """Bytes of the trajectory the run keeps until it returns (`memory_plan`'s caches column): the canvas
        `x_steps` (int64 `[batch, prompt + gen]`) of each of at most `steps` steps."""
        return steps * batch * (prompt_length + self.answer_length(settings)) * 8

    def logit_bytes(self, settings: SamplerSettings, dtype_bytes: int) -> int:
        """Bytes the sampler step allocates per logit it processes (`memory_plan`'s head phase); default the
        measured LLaDA / Fast-dLLM figures (`mdm_lens.hooks.forward_bytes.sampler_logit_bytes`)."""
        from mdm_lens.hooks.forward_bytes import sampler_logit_bytes

        return sampler_logit_bytes(settings, dtype_bytes)

    def carried_bytes(self, settings: SamplerSettings, dtype_bytes: int) -> tuple[int, int]:
        """Bytes per logit of the previous step the sampler still references while its next forward runs
        (`memory_plan`'s block phase): (per logit of every forward row, per logit of the sampled rows only);
        default the measured LLaDA / Fast-dLLM figures (`mdm_lens.hooks.forward_bytes.carried_logit_bytes`), 0."""
        from mdm_lens.hooks.forward_bytes import carried_logit_bytes

        return carried_logit_bytes(settings, dtype_bytes), 0

    def row_logit_bytes(self, settings: SamplerSettings, dtype_bytes: int) -> int:
        """Bytes per logit of every forward row (not only the sampled ones) the sampler step allocates beside the
        logits, e.g. a token-shifted copy; default 0."""
        return 0

    def attention_extra_bytes(self, settings: SamplerSettings, cfg: Any, batch: int,
                              extent: tuple[int, int, int, int], dtype_bytes: int) -> int:
        """Bytes one layer's attention allocates in a forward of `extent` (`forward_extents`' tuple) beyond the
        generic byte model (`mdm_lens.hooks.forward_bytes.attention_phase_bytes`), e.g. a cache read back as a
        copy; default 0 (the generic model is the forward)."""
        return 0

    def check_inputs(self, model: Any, ids: Any, am: Any, settings: SamplerSettings, obs: Observation) -> None:
        """Every check `generate` runs on the prompt ids `[batch, pos]`, their attention mask and the settings before
        any compute; `memory_plan` runs the same, so a plan exists only for a run `generate` accepts."""

    def generate(self, model: Any, prompt: Any, settings: SamplerSettings, obs: Observation) -> Any:
        raise NotImplementedError

    def replay_state(self, out: Any, state: Any) -> Any:
        """Step `state.step`'s `DenoisingState` as `replay` rebuilt it from `out`, completed with what this sampler
        set on it beyond the canvas sets (e.g. the step's noise level in `extra`); default: unchanged."""
        return state


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except (TypeError, ValueError, RuntimeError):
        return False


def _foreign(sampler: Sampler, option: str, value: Any, owners: list[Sampler]) -> SamplerConfigError:
    allowed = sorted(settings_names(sampler))
    hint = f" ({option} → {sampler.renamed[option]})" if option in sampler.renamed else ""
    if option in sampler.absent:
        hint = f" ({sampler.absent[option]})"
    where = ""
    if owners:
        which = " / ".join(repr(s.name) for s in owners)
        where = f": it is a setting of sampler {which}, which the {sampler.name!r} sampler would ignore"
    return SamplerConfigError(f"unknown setting {option}={validate.describe(value)} for sampler {sampler.name!r}"
                              f"{where}{hint}. Its settings: {allowed}.", argument=option, value=value,
                              allowed=", ".join(allowed))


_REGISTRY: dict[str, Sampler] = {}


def register(sampler: Sampler, *, replace: bool = False) -> Sampler:
    """Make `sampler` available as `generate(..., sampler=sampler.name)`. A name already registered (a built-in
    such as "llada") is refused unless `replace=True`; every caller-settable field needs a rule (`Settings.rules`)."""
    if not isinstance(sampler, Sampler):
        raise ArgumentTypeError(f"register({validate.describe(sampler)}): expected a Sampler instance (a subclass "
                                "with `name`, `Settings` and `generate`).", argument="sampler", value=sampler,
                                allowed="a mdm_lens.diffusion.registry.Sampler instance")
    name = getattr(sampler, "name", None)
    if not isinstance(name, str) or not name:
        raise ArgumentTypeError(f"{type(sampler).__name__}.name={name!r}: expected a non-empty str.",
                                argument="sampler.name", value=name, allowed="a non-empty str")
    settings = getattr(sampler, "Settings", None)
    if not (isinstance(settings, type) and dataclasses.is_dataclass(settings) and issubclass(settings, SamplerSettings)):
        raise ArgumentTypeError(f"{type(sampler).__name__}.Settings must be a SamplerSettings dataclass.",
                                argument="sampler.Settings", value=settings, allowed="a SamplerSettings dataclass")
    missing = undeclared(settings)
    if missing:
        raise SamplerConfigError(f"{settings.__name__} declares no rule for {missing}: add them to its `rules` table "
                                 "(mdm_lens.diffusion.rules).", argument="sampler.Settings", value=missing,
                                 allowed="a rule per field")
    if name in _REGISTRY and _REGISTRY[name] is not sampler and not validate.boolean(replace, name="replace"):
        raise SamplerConfigError(f"a sampler named {name!r} is already registered "
                                 f"({type(_REGISTRY[name]).__name__}); pass replace=True to replace it, or pick "
                                 "another name.", argument="sampler.name", value=name,
                                 allowed=f"a name not in {sorted(_REGISTRY)}, or replace=True")
    _REGISTRY[name] = sampler
    return sampler


def names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def get(name: Any) -> Sampler:
    return _REGISTRY[validate.choice(name, names(), name="sampler", error=SamplerConfigError)]


def unpassed(sampler: Sampler, error: ArgumentError, given: dict[str, Any]) -> ArgumentError:
    """`error` from `resolve`, saying so when the value it blames was never passed: a setting's default (or the value
    taken from the checkpoint) that conflicts with what was passed would otherwise read as the caller's mistake."""
    fields = {f.name: f for f in dataclasses.fields(sampler.Settings)}
    name = error.argument
    if name is None or name in given or name not in fields:
        return error
    default = fields[name].default
    if (default is None or default is dataclasses.MISSING) and error.value is None:
        return error  # the checkpoint names no value (nothing conflicts): the error already asks for one
    if default is DEFAULT:  # the model's own value, which conflicts with the model (not with what was passed)
        note = (f" You did not pass {name}: it took {error.value!r}, the checkpoint's value (model.cfg.{name}); "
                f"pass {name}= explicitly" + (f" ({error.allowed})." if error.allowed else "."))
        return type(error)(str(error) + note, argument=name, value=error.value, allowed=error.allowed)
    source = (f"its default is {default!r}" if default is not None and default is not dataclasses.MISSING
              else f"it took {error.value!r}, the checkpoint's value (model.cfg) or else the sampler's own default")
    note = (f" You did not pass {name}: {source}, which conflicts with the settings given "
            f"({', '.join(f'{k}={v!r}' for k, v in given.items()) or 'none'}); pass {name}= explicitly"
            + (f" ({error.allowed})." if error.allowed else "."))
    return type(error)(str(error) + note, argument=name, value=error.value, allowed=error.allowed)


def settings_names(sampler: Sampler) -> set[str]:
    """The settings a caller may pass (fields marked `resolved()` are filled by `resolve`, e.g. checkpoint ids)."""
    return {f.name for f in dataclasses.fields(sampler.Settings) if not f.metadata.get("resolved")}


def own_lengths(sampler: Sampler, optional: tuple[str, ...] = (), **lengths: Any) -> dict[str, Any]:
    """`n_steps` / `gen_length` / `block_length` under the sampler's own names (Fast-dLLM v2: `max_new_tokens`,
    `block_size`, and no `steps`; the sampler's `renamed` map), for callers that speak LLaDA's names (the export,
    the sweep). None values are left to the sampler's defaults; one the sampler has no setting for is refused,
    unless it is named in `optional` (a caller's default, not the user's choice: dropped)."""
    own = settings_names(sampler)
    out: dict[str, Any] = {}
    for name, value in lengths.items():
        if value is None:
            continue
        key = "steps" if name == "n_steps" else name
        key = sampler.renamed.get(key, key)
        if key not in own:
            if name in optional:
                continue
            # why it has none: the sampler's own word (BD3LM: the block is config.json's block_size), else, for the
            # step count, that the sampler decides it
            why = sampler.absent.get(key) or sampler.absent.get(name) or (
                "it decides its number of forwards itself" if name == "n_steps" else "it takes no such setting")
            raise SamplerConfigError(f"{name}={value!r}: sampler {sampler.name!r} has no such setting ({why}); leave "
                                     "it unset.", argument=name, value=value, allowed=f"None for sampler {sampler.name!r}")
        out[key] = value
    return out


def resolved_names(sampler: Sampler) -> set[str]:
    """Fields `resolve` fills from the model (e.g. `eos_id`): shown on `out.settings`, refused as keywords."""
    return {f.name for f in dataclasses.fields(sampler.Settings) if f.metadata.get("resolved")}


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
