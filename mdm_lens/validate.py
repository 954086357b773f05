"""The one place where public arguments are checked.

Every public function validates its layers, heads, steps, positions, shapes, dtypes and values through these
helpers, so that a wrong argument always raises a typed error (`mdm_lens.errors.ArgumentError` and its
subclasses) whose message names the argument, the value given and what is allowed -- never a silent wrap-around
(``layers=[7]`` on a 4-layer model is an error, not layer 3) and never a plausible wrong number.

Negative indices mean what they mean in Python: ``-1`` is the last layer / step / position.

    layer = validate.index(layer, model.cfg.n_layers, name="layer")          # -> 0 <= layer < n_layers
    layers = validate.indices(layers, model.cfg.n_layers, name="layers")     # None -> all, int -> [int]
    steps = validate.integer(steps, name="steps", min=1)
    validate.tensor(pattern, name="pattern", ndim=4, dtype="float", finite=True)
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Iterable, Sequence, TypeVar

import torch
from torch import Tensor

from mdm_lens.errors import (ArgumentError, ArgumentTypeError, InputTypeError, NonFiniteError, OutOfRangeError,
                             SamplerConfigError, SamplerConfigTypeError)

__all__ = ["index", "indices", "integer", "number", "boolean", "choice", "instances", "tensor", "finite",
           "same_shape", "describe", "device", "id_tensor", "distinct_ids"]

T = TypeVar("T")

_DTYPE_KINDS = {
    "float": (torch.float16, torch.bfloat16, torch.float32, torch.float64),
    "int": (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8),
    "bool": (torch.bool,),
}


def describe(value: Any) -> str:
    """A short repr for messages: tensors by shape and dtype, long sequences cut."""
    if isinstance(value, Tensor):
        return f"tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _fail(error: type[ArgumentError], name: str, value: Any, allowed: str, detail: str = "") -> ArgumentError:
    message = f"{name}={describe(value)} is invalid: {allowed}" + (f" ({detail})" if detail else "") + "."
    return error(message, argument=name, value=value, allowed=allowed)


def _is_int(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, Tensor):
        return value.ndim == 0 and not value.is_floating_point() and value.dtype != torch.bool
    return isinstance(value, numbers.Integral)


def _type_error(error: type[ArgumentError]) -> type[ArgumentError]:
    """The wrong-type error for a check whose range error is `error`: a sampler setting of the wrong type is a
    `SamplerConfigError` too (`SamplerConfigTypeError`), so a caller catching those is not bypassed by a type slip."""
    return SamplerConfigTypeError if issubclass(error, SamplerConfigError) else ArgumentTypeError


def integer(value: Any, *, name: str, min: int | None = None, max: int | None = None,
            error: type[ArgumentError] = ArgumentError) -> int:
    """An int (not a bool, not a float such as 4.5 or 4.0) within [min, max]."""
    bounds = _bounds(min, max)
    if not _is_int(value):
        raise _fail(_type_error(error), name, value, f"expected an int{bounds}")
    value = int(value)
    if (min is not None and value < min) or (max is not None and value > max):
        raise _fail(error, name, value, f"expected an int{bounds}")
    return value


def _bounds(low: Any, high: Any, low_open: bool = False, high_open: bool = False) -> str:
    if low is not None and high is not None:
        return f" in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    if low is not None:
        return f" {'>' if low_open else '>='} {low}"
    if high is not None:
        return f" {'<' if high_open else '<='} {high}"
    return ""


def number(value: Any, *, name: str, min: float | None = None, max: float | None = None, min_open: bool = False,
           max_open: bool = False, error: type[ArgumentError] = ArgumentError) -> float:
    """A finite real number (int or float, not a bool) within the given (open or closed) bounds."""
    bounds = _bounds(min, max, min_open, max_open)
    if isinstance(value, Tensor) and value.ndim == 0 and value.dtype != torch.bool:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _fail(_type_error(error), name, value, f"expected a number{bounds}")
    value = float(value)
    if not math.isfinite(value):
        raise _fail(error, name, value, f"expected a finite number{bounds}")
    too_low = min is not None and (value <= min if min_open else value < min)
    too_high = max is not None and (value >= max if max_open else value > max)
    if too_low or too_high:
        raise _fail(error, name, value, f"expected a number{bounds}")
    return value


def boolean(value: Any, *, name: str) -> bool:
    if not isinstance(value, bool):
        raise _fail(ArgumentTypeError, name, value, "expected True or False")
    return value


def choice(value: Any, allowed: Iterable[T], *, name: str, error: type[ArgumentError] = ArgumentError) -> T:
    """One of `allowed` (compared with ==); the message lists them all."""
    allowed = list(allowed)
    for option in allowed:
        if type(value) is type(option) and value == option:
            return option
    raise _fail(error, name, value, "expected one of " + ", ".join(repr(a) for a in allowed))


def article(word: str) -> str:
    """"an" before a vowel letter ("an answer position", "an index"), else "a" (messages built from a noun)."""
    return "an" if word[:1].lower() in "aeiou" and word[:1] else "a"


def index(value: Any, size: int, *, name: str, what: str = "index",
          error: type[ArgumentError] = OutOfRangeError) -> int:
    """An int index into `size` items, negative counting from the end; returns it in [0, size)."""
    if not _is_int(value):
        raise _fail(ArgumentTypeError, name, value, f"expected an int {what} in [-{size}, {size - 1}]")
    value = int(value)
    if size <= 0:
        raise _fail(error, name, value, f"there is no {what} to index (0 available)")
    if not -size <= value < size:
        raise _fail(error, name, value, f"expected {article(what)} {what} in [-{size}, {size - 1}]",
                    f"there are {size}; negative values count from the end")
    return value % size


def indices(value: Any, size: int, *, name: str, what: str = "index", allow_empty: bool = False,
            unique: bool = True, error: type[ArgumentError] = OutOfRangeError) -> list[int]:
    """None (all), an int, a range, a slice, a 1-d int tensor or a sequence of ints -> a list in [0, size).

    Duplicates are an error when `unique` (``layers=[1, -3]`` on 4 layers names layer 1 twice)."""
    if value is None:
        return list(range(size))
    if isinstance(value, slice):
        return list(range(size))[value] or _empty(name, value, what, size, allow_empty, error)
    if _is_int(value):
        return [index(value, size, name=name, what=what, error=error)]
    if isinstance(value, Tensor):
        if value.ndim != 1 or value.is_floating_point() or value.dtype == torch.bool:
            raise _fail(ArgumentTypeError, name, value, f"expected a 1-d integer tensor of {what}s")
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, range)):
        raise _fail(ArgumentTypeError, name, value, f"expected None, an int or a sequence of int {what}s")
    out = [index(v, size, name=f"{name}[{i}]", what=what, error=error) for i, v in enumerate(value)]
    if not out:
        return _empty(name, value, what, size, allow_empty, error)
    if unique and len(set(out)) != len(out):
        raise _fail(error, name, value, f"expected each {what} at most once",
                    "a negative index names the same one as its positive twin")
    return out


def _empty(name: str, value: Any, what: str, size: int, allow_empty: bool, error: type[ArgumentError]) -> list[int]:
    if allow_empty:
        return []
    raise _fail(error, name, value, f"expected at least one {what} out of {size}")


def instances(value: Any, types: type | tuple[type, ...], *, name: str, allow_single: bool = False) -> list[Any]:
    """A list/tuple whose items are all of `types`. A lone item is an error unless `allow_single`
    (``record=ReceivedAttention()`` instead of ``record=[ReceivedAttention()]``)."""
    names = types.__name__ if isinstance(types, type) else " or ".join(t.__name__ for t in types)
    if isinstance(value, types) and not isinstance(value, (list, tuple)):
        if allow_single:
            return [value]
        raise _fail(ArgumentTypeError, name, value, f"expected a list of {names}", f"write {name}=[...]")
    if not isinstance(value, (list, tuple)):
        raise _fail(ArgumentTypeError, name, value, f"expected a list of {names}")
    for i, item in enumerate(value):
        if not isinstance(item, types):
            raise _fail(ArgumentTypeError, f"{name}[{i}]", item, f"expected {article(names)} {names}")
    return list(value)


def tensor(value: Any, *, name: str, ndim: int | Sequence[int] | None = None,
           shape: Sequence[int | None] | None = None, dtype: str | Sequence[str] | None = None,
           finite: bool = False, nonempty: bool = True) -> Tensor:
    """A torch tensor of the given rank, shape (None = any size on that axis) and dtype kind
    ("float", "int", "bool"); `finite` refuses NaN/inf; `nonempty` refuses a tensor with no elements."""
    if not isinstance(value, Tensor):
        raise _fail(ArgumentTypeError, name, value, "expected a torch.Tensor")
    if nonempty and value.numel() == 0:  # first: torch.tensor([]) is 1-d float, but "empty" is the real news
        raise _fail(ArgumentError, name, value, "expected a non-empty tensor", "it is empty")
    if ndim is not None:
        ranks = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if value.ndim not in ranks:
            raise _fail(ArgumentError, name, value, f"expected {' or '.join(map(str, ranks))} dimensions")
    if shape is not None:
        want = tuple(shape)
        ok = len(want) == value.ndim and all(w is None or w == s for w, s in zip(want, value.shape))
        if not ok:
            pretty = "[" + ", ".join("*" if w is None else str(w) for w in want) + "]"
            raise _fail(ArgumentError, name, value, f"expected shape {pretty}")
    if dtype is not None:
        kinds = (dtype,) if isinstance(dtype, str) else tuple(dtype)
        if not any(value.dtype in _DTYPE_KINDS[k] for k in kinds):
            if value.numel() == 0:
                raise _fail(ArgumentError, name, value, f"expected a non-empty {' or '.join(kinds)} tensor",
                            "it is empty (torch.tensor([]) is float32 by default)")
            kind = " or ".join(kinds)
            raise _fail(ArgumentTypeError, name, value, f"expected {article(kind)} {kind} tensor")
    if finite:
        _finite(value, name=name)
    return value


def finite(value: Tensor, *, name: str, nan_policy: str = "raise") -> Tensor:
    """Refuse NaN/inf (``nan_policy="raise"``), or pass them on unchanged (``"propagate"``)."""
    choice(nan_policy, ("raise", "propagate"), name="nan_policy")
    if nan_policy == "raise" and value.is_floating_point() and not bool(torch.isfinite(value).all()):
        n_nan, n_inf = int(torch.isnan(value).sum()), int(torch.isinf(value).sum())
        raise _fail(NonFiniteError, name, value, "expected finite values",
                    f"{n_nan} NaN and {n_inf} inf of {value.numel()}")
    return value


_finite = finite  # `tensor` has an argument named `finite`


def same_shape(a: Tensor, b: Tensor, *, names: tuple[str, str]) -> None:
    if tuple(a.shape) != tuple(b.shape):
        raise ArgumentError(f"{names[0]} has shape {tuple(a.shape)} but {names[1]} has shape {tuple(b.shape)}; "
                            "they must match.", argument=names[1], value=b, allowed=f"shape {tuple(a.shape)}")


def device(value: Any, *, name: str = "device") -> torch.device:
    """A torch device this machine has: a bad string is an `ArgumentTypeError`, ``"cuda"`` without CUDA (or a
    CUDA index past the last GPU) an `ArgumentError` saying so, before anything is moved."""
    try:
        dev = torch.device(value)
    except (RuntimeError, TypeError, ValueError) as err:
        raise _fail(ArgumentTypeError, name, value, "expected a torch device such as 'cpu', 'cuda' or 'cuda:0'",
                    str(err)) from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise _fail(ArgumentError, name, value, "CUDA is not available on this machine",
                        "torch.cuda.is_available() is False; use 'cpu'")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise _fail(OutOfRangeError, name, value, f"expected a CUDA index below {torch.cuda.device_count()}")
    if dev.type == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise _fail(ArgumentError, name, value, "MPS is not available on this machine")
    return dev


SEED_MAX = 2**64 - 1  # torch.Generator.manual_seed takes [-2**63, 2**64): beyond, a raw "Overflow" ValueError


def seed(value: Any, *, name: str = "seed", min: int | None = 0) -> int:
    """A seed torch's generators take: an int in [min, 2**64 - 1] (`min=None`: down to -2**63, as torch)."""
    return integer(value, name=name, min=-(2**63) if min is None else min, max=SEED_MAX)


def storage_device(value: Any, *, name: str = "device", what: str = "cached activations") -> torch.device:
    """`device`, and one that holds values: 'meta' keeps shapes only, so whatever is stored there is lost."""
    dev = device(value, name=name)
    if dev.type == "meta":
        raise _fail(ArgumentError, name, value, "expected a device that holds values, such as 'cpu' or 'cuda'",
                    f"'meta' holds shapes but no values, so the {what} would be lost")
    return dev


def _leaves(value: Any) -> Iterable[Any]:
    for v in value:
        if isinstance(v, (list, tuple)):
            yield from _leaves(v)
        else:
            yield v


def id_tensor(value: Any, *, name: str) -> Tensor:
    """Token ids given as a tensor or (nested) lists / tuples of ints, as a tensor; a ragged list
    (``[[1, 2], [3]]``) is an `InputTypeError` naming `name`, an empty one an `ArgumentError` saying it is empty
    (``torch.as_tensor([])`` would make a float tensor and blame the dtype). Anything else is returned as is,
    for the caller's own type check."""
    if not isinstance(value, (list, tuple)):
        return value
    bad = [v for v in _leaves(value) if not _is_int(v)][:1]  # a list: the bad leaf may itself be None
    if bad:
        raise _fail(InputTypeError, name, value, "expected an int tensor or a (nested) list of int ids",
                    f"it holds {describe(bad[0])}")
    try:
        t = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        raise _fail(InputTypeError, name, value, "expected an int tensor or a rectangular (nested) list of ints",
                    "its rows have different lengths: pad them") from None
    if t.numel() == 0:
        raise _fail(ArgumentError, name, value, "expected at least one token id", "it is empty")
    return t


def distinct_ids(ids: dict[str, Any], *, why: str, error: type[Exception] = ArgumentError) -> None:
    """Refuse two special-token roles sharing one id (`None` entries are unset and skipped). One check for the
    loaders (`error=ConfigError`) and the samplers (`error=SamplerConfigError`, before any forward): a sampler
    reads the same ids from `cfg.extra` or its keywords after load, where a collision silently changes what the
    run means (a mask that is also EOS freezes every position; an expand id that is also the mask id grows the
    canvas forever). `why` says what this sampler / format does with the ids."""
    seen: dict[int, str] = {}
    for name, value in ids.items():
        if value is None:
            continue
        if int(value) in seen:
            other = seen[int(value)]
            msg = (f"{other}={int(value)} and {name}={int(value)} are the same token: {why} Give them distinct ids "
                   f"(now {', '.join(f'{k}={v}' for k, v in ids.items())}).")
            if issubclass(error, ArgumentError):
                raise error(msg, argument=name, value=int(value), allowed=f"an id other than {other}'s")
            raise error(msg)
        seen[int(value)] = name


def keywords(given: dict[str, Any], accepted: Sequence[str], *, where: str,
             notes: dict[str, str] | None = None) -> None:
    """Refuse keywords `where` does not take (Python's own error is a bare TypeError), naming the nearest accepted
    one and, from `notes`, why a known foreign keyword (e.g. TransformerLens' `stop_at_layer`) is not taken."""
    import difflib

    for key in given:
        if key in accepted:
            continue
        close = difflib.get_close_matches(key, list(accepted), n=1, cutoff=0.6)
        hint = f" Did you mean {close[0]}=?" if close else ""
        note = f" {notes[key]}" if notes and key in notes else ""
        raise ArgumentError(f"{where}() got an unknown keyword {key}={describe(given[key])}.{hint}{note} Accepted: "
                            f"{', '.join(accepted)}.", argument=key, value=given[key], allowed=", ".join(accepted))


def known_keywords(fn: Any) -> Any:
    """Decorator: an unknown keyword to `fn` (which takes no **kwargs) is the typed error of `keywords`."""
    import functools
    import inspect

    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        raise TypeError(f"known_keywords: {fn.__name__} takes **kwargs; check those where they are read")
    accepted = tuple(p for p in params if p != "self" and params[p].kind is not inspect.Parameter.VAR_POSITIONAL)

    @functools.wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> Any:
        keywords(kwargs, accepted, where=fn.__name__)
        return fn(*args, **kwargs)

    return checked


def path_kind(path: Any, *, name: str) -> str:
    """"dir", "file" or "missing" for a user-given path; a path the OS cannot even look up (a component over the
    file-name limit: "a" * 5000, a symlink loop) is an `ArgumentError` naming the argument, not a raw OSError from
    `Path.is_dir()`."""
    from pathlib import Path

    p = Path(path).expanduser()
    try:
        return "dir" if p.is_dir() else "file" if p.exists() else "missing"
    except (OSError, ValueError) as e:  # ENAMETOOLONG, ELOOP; ValueError: an embedded NUL byte
        text = str(path)
        shown = text if len(text) <= 80 else f"{text[:60]}… ({len(text)} characters)"
        why = getattr(e, "strerror", None) or str(e)
        raise ArgumentError(f"{name}={shown!r} is not a usable path ({why}): expected a folder or file path the "
                            "OS can look up (each component at most 255 bytes), or a name.", argument=name,
                            value=shown, allowed="a path of valid length") from e


def output_file(path: Any, *, name: str, suffixes: Sequence[str] | None = None, make_parents: bool = False) -> Any:
    """A file path to write: not an existing folder, its parent an existing folder (the OS errors would be raw).

    `suffixes` (e.g. ``(".png",)``, compared case-insensitively): the only endings allowed, for a writer whose
    format is fixed (a PNG written as ``x.xyz`` would be a file no viewer opens by its name). `make_parents`: the
    writer creates missing folders, so only an ancestor that is a file (mkdir would fail inside the OS) is refused."""
    from pathlib import Path

    if not isinstance(path, (str, Path)) or str(path) == "":
        raise ArgumentTypeError(f"{name}={path!r} is invalid: expected a file path.", argument=name, value=path,
                                allowed="a str or pathlib.Path")
    p = Path(path)
    example = p / ("figure" + suffixes[0] if suffixes else "page.html")
    if path_kind(p, name=name) == "dir":
        raise ArgumentError(f"{name}={str(p)!r} is a folder: give a file path (e.g. {str(example)!r}).",
                            argument=name, value=str(p), allowed="a file path")
    if suffixes is not None and p.suffix.lower() not in [x.lower() for x in suffixes]:
        ends = " or ".join(suffixes)
        raise ArgumentError(f"{name}={str(p)!r} is invalid: expected a file name ending in {ends} (the file is "
                            f"written in that format whatever its name; e.g. {str(p.with_suffix(suffixes[0]))!r}).",
                            argument=name, value=str(p), allowed=f"a path ending in {ends}")
    if make_parents:
        folder = p.parent
        while path_kind(folder, name=name) == "missing" and folder != folder.parent:
            folder = folder.parent
        if path_kind(folder, name=name) == "file":
            raise ArgumentError(f"{name}={str(p)!r}: {str(folder)!r} on its way is a file, so its folder cannot be "
                                "created.", argument=name, value=str(p), allowed="a path whose folders are folders")
    elif not p.parent.is_dir():
        raise ArgumentError(f"{name}={str(p)!r}: its folder {str(p.parent)!r} does not exist (or is a file).",
                            argument=name, value=str(p), allowed="a path in an existing folder")
    return p


def known_name(value: Any, known: Iterable[str], *, name: str, what: str) -> str:
    """A str among `known` when that set is too large to list in a message (matplotlib's colormaps): the message
    names the nearest known names instead of all of them."""
    import difflib

    known = sorted(known)
    if isinstance(value, str) and value in known:
        return value
    close = difflib.get_close_matches(str(value), known, n=3, cutoff=0.5) if isinstance(value, str) else []
    hint = f"; nearest: {', '.join(map(repr, close))}" if close else f"; e.g. {', '.join(map(repr, known[:3]))}"
    error = ArgumentError if isinstance(value, str) else ArgumentTypeError
    raise error(f"{name}={describe(value)} is invalid: expected the name of {article(what)} {what} "
                f"({len(known)} known{hint}).", argument=name, value=value,
                allowed=f"the name of {article(what)} {what}")


def output_folder(path: Any, *, name: str, allowed: str = "a folder path (new or existing)") -> Any:
    """A folder to write into: a path that is not an existing file (the OS errors would be raw, and only later)."""
    from pathlib import Path

    if not isinstance(path, (str, Path)) or str(path) == "":
        raise ArgumentTypeError(f"{name}={path!r} is invalid: expected a folder path.", argument=name, value=path,
                                allowed="a str or pathlib.Path")
    p = Path(path)
    if path_kind(p, name=name) == "file":
        raise ArgumentError(f"{name} {str(p)!r} is a file, not a folder; choose a folder path.", argument=name,
                            value=str(p), allowed=allowed)
    return p
