"""Per-setting rules every sampler declares and the registry applies the same way.

Each `SamplerSettings` subclass lists, in its `rules` table, every field a caller may pass: the values it accepts
(`Rule.check`, with `allowed` in words and `bad` examples the tests feed it) and, for an option that only acts
under another one, `active(settings)` with `when` naming that option. `check_given` refuses, before any compute,
an out-of-range value and an option set away from its default while inactive (its message names the option that
activates it): an inert option is never accepted silently. `Settings.resolve` then fills model-dependent values.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from mdm_lens import validate
from mdm_lens.errors import SamplerConfigError


@dataclass(frozen=True)
class Rule:
    check: Callable[[Any, str], Any] | None = None  # raises the typed error of mdm_lens.validate; None: any value
    allowed: str = "any value"
    bad: tuple = ()  # values `check` refuses (the table-driven tests use them)
    active: Callable[[Any], bool] | None = None  # None: always acts
    when: str = ""  # the option(s) under which it acts
    on: dict[str, Any] = dataclasses.field(default_factory=dict)  # other settings under which it acts (for tests)
    off: dict[str, Any] = dataclasses.field(default_factory=dict)  # other settings under which it is inert
    # for an option that another one switches off (e.g. LLaDA's `steps` under `threshold`): names what makes it inert
    # in these settings, so the refusal says "under threshold=0.9" rather than "set that too"
    inert_by: Callable[[Any], str] | None = None


def _or_none(none: bool, check: Callable[[Any, str], Any]) -> Callable[[Any, str], Any]:
    return lambda v, name: None if (v is None and none) else check(v, name)


def number(low: float | None = None, high: float | None = None, *, none: bool = False, low_open: bool = False,
           high_open: bool = False, **kw: Any) -> Rule:
    """A finite number in [low, high] (`low_open` / `high_open`: that end excluded); `none`: None allowed too."""
    check = _or_none(none, lambda v, name: validate.number(v, name=name, min=low, max=high, min_open=low_open,
                                                           max_open=high_open, error=SamplerConfigError))
    span = (f"{'(' if low_open else '['}{'-inf' if low is None else low}, {'inf' if high is None else high}"
            f"{')' if high_open else ']'}")
    bad: list[Any] = [float("nan"), float("inf"), "0.5"] + ([] if none else [None])
    bad += ([] if high is None else [high if high_open else high + 0.5])
    bad += [] if low is None else [low if low_open else low - 1]
    return Rule(check, f"a finite number in {span}" + (" or None" if none else ""), tuple(bad), **kw)


def integer(low: int | None = None, high: int | None = None, *, none: bool = False, **kw: Any) -> Rule:
    check = _or_none(none, lambda v, name: validate.integer(v, name=name, min=low, max=high,
                                                            error=SamplerConfigError))
    bad: Any = [2.5, "8", True] + ([] if none else [None]) + ([] if low is None else [low - 1])
    bad = tuple(bad + ([] if high is None else [high + 1]))
    return Rule(check, f"an int >= {low}" + (f" and <= {high}" if high is not None else "") + (" or None" if none else ""),
                bad, **kw)


def boolean(**kw: Any) -> Rule:
    return Rule(lambda v, name: validate.boolean(v, name=name), "True or False", (1, "yes", None), **kw)


def choice(options: tuple, *, none: bool = False, **kw: Any) -> Rule:
    listed = tuple(options) + ((None,) if none else ())  # the refusal lists None too when None is allowed
    check = _or_none(none, lambda v, name: validate.choice(v, listed, name=name, error=SamplerConfigError))
    return Rule(check, f"one of {options}" + (" or None" if none else ""), ("nope", 3), **kw)


def anything(allowed: str = "any value (checked against the model by resolve)", **kw: Any) -> Rule:
    return Rule(None, allowed, (), **kw)


def check_given(sampler_name: str, settings: Any, given: dict[str, Any]) -> None:
    """Every option the caller gave: in range (validate's typed errors), and active (or left at its default)."""
    rules: dict[str, Rule] = type(settings).rules
    defaults = {f.name: f.default for f in dataclasses.fields(settings)}
    for name, value in given.items():
        if rules[name].check is not None:
            rules[name].check(value, name)
    for name, value in given.items():
        rule = rules[name]
        if rule.active is not None and not rule.active(settings) and not _same(value, defaults[name]):
            if rule.inert_by is not None:
                raise SamplerConfigError(f"{name}={validate.describe(value)} has no effect on sampler "
                                         f"{sampler_name!r} under {rule.inert_by(settings)}; {name} acts unless "
                                         f"{rule.when}. Leave {name} at its default {defaults[name]!r}.",
                                         argument=name, value=value, allowed=f"{defaults[name]!r} unless {rule.when}")
            raise SamplerConfigError(f"{name}={validate.describe(value)} has no effect on sampler {sampler_name!r} "
                                     f"unless {rule.when}; set that too, or leave {name} at its default "
                                     f"{defaults[name]!r}.", argument=name, value=value,
                                     allowed=f"{defaults[name]!r} unless {rule.when}")


def apply(settings: Any, name: str) -> Any:
    """`settings.name` checked by its own rule: `resolve` calls this instead of restating the interval, so the
    interval checked and the one its message names are the rules table's, whichever step refuses the value."""
    rule = type(settings).rules[name]
    value = getattr(settings, name)
    return value if rule.check is None else rule.check(value, name)


def _same(a: Any, b: Any) -> bool:
    try:
        return a is b or bool(a == b)
    except (TypeError, ValueError, RuntimeError):
        return False


def undeclared(settings_cls: type) -> list[str]:
    """Caller-settable fields with no rule (a registry refusal names them)."""
    return [f.name for f in dataclasses.fields(settings_cls)
            if not f.metadata.get("resolved") and f.name not in getattr(settings_cls, "rules", {})]


class DerivedSteps(int):
    """A `steps` value a probe derived itself because its caller passed none (gen_length): the probe's default, not
    the caller's choice. A rule that decides the number of forwards itself (`steps_unless`) lets it through, where
    it refuses any `steps` the caller passed, whatever its value."""


def derived_steps(given: Any, fallback: int) -> Any:
    """The `steps=` a probe passes to `generate`: the caller's `given` when there is one (checked by the sampler as
    the caller's), else `fallback` marked as derived (`DerivedSteps`)."""
    return given if given is not None else DerivedSteps(fallback)


def steps_unless(switches: dict[str, Any], when: str, **kw: Any) -> Rule:
    """`steps` for a sampler whose `switches` (option → its default) select a rule that decides the number of
    forwards itself (Fast-dLLM's threshold / factor, EB-sampler): any `steps` the caller passed under one of them is
    refused naming it, also one equal to gen_length (it would be ignored, not obeyed). A probe that passes its own
    default (`DerivedSteps`: the caller gave none) is let through."""
    def active(s: Any) -> bool:
        return all(_same(getattr(s, k), v) for k, v in switches.items()) or isinstance(s.steps, DerivedSteps)

    def inert_by(s: Any) -> str:
        on = [f"{k}={getattr(s, k)!r}" for k, v in switches.items() if not _same(getattr(s, k), v)]
        return " and ".join(on) + " (which decides how many forwards run: `out.trajectory.n_steps` counts them)"

    first = next(iter(switches))
    return dataclasses.replace(integer(1, none=True, **kw), active=active, when=when, inert_by=inert_by,
                               off={first: 0.9})


def sampling_filters() -> dict[str, Rule]:
    """`top_p` / `top_k` of a sampler that decodes greedily at temperature 0 without reading the filtered
    distribution there (the ARM, LLaDA2): the filters act only at temperature > 0."""
    at_t = dict(active=lambda s: s.temperature is not None and s.temperature > 0, when="temperature > 0",
                on={"temperature": 0.5})
    return {"top_p": number(0, 1, none=True, low_open=True, **at_t), "top_k": integer(1, none=True, **at_t)}
