"""Placing a `HookedMDM` over several devices: device maps, CPU/disk offloading, dispatch — all accelerate's.

`from_pretrained(..., device_map=..., max_memory=..., n_devices=..., offload_folder=...)` keeps transformers'
meanings. The plan is accelerate's (`infer_auto_device_map`, `get_balanced_memory`) over a meta-device model with
the block classes unsplittable, so the placement unit is the block. Each checkpoint tensor goes from its file
straight to its target (a device, or accelerate's disk offload under `offload_folder`); `dispatch_model` then
adds the hooks that move the residual stream at block boundaries and load offloaded weights where the block runs.
Our hook points sit inside the blocks, so they fire on the device the block runs on.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor, nn

from mdm_lens import validate
from mdm_lens.errors import ArgumentError, ArgumentTypeError, ConfigError
from mdm_lens.loading.placement_checks import check_max_memory, plain_device_map

DeviceMap = dict[str, "int | str"]
STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


def no_split_classes(model: nn.Module) -> list[str]:
    """The block classes: accelerate never splits one across devices (the residual moves only between blocks)."""
    return sorted({type(b).__name__ for b in model.blocks})


def n_devices_memory(n_devices: Any, max_memory: dict | None) -> dict | None:
    """TL's `n_devices`: the first N accelerators (balanced). Refused where fewer exist (a CPU-only machine has 0);
    `n_devices=1` is one device, i.e. the plain `device=` load."""
    n = validate.integer(n_devices, name="n_devices", min=1)
    available = torch.cuda.device_count()
    if n > available:
        raise ArgumentError(f"n_devices={n} is invalid: this machine has {available} CUDA device(s) "
                            "(torch.cuda.device_count()); on CPU use device_map with 'cpu'/'disk' entries and "
                            "offload_folder= to offload.", argument="n_devices", value=n,
                            allowed=f"1..{max(available, 1)}")
    if max_memory is not None:
        return {k: v for k, v in max_memory.items() if not isinstance(k, int) or k < n}
    from accelerate.utils import get_max_memory

    return {k: v for k, v in get_max_memory().items() if isinstance(k, int) and k < n}


def plan(meta_model: nn.Module, device_map: Any, max_memory: dict | None, dtype: torch.dtype) -> DeviceMap:
    """The device map: a strategy name planned by accelerate on `max_memory` (any device names, real or not), or a
    user dict checked for coverage. Pure planning: nothing is allocated, so it runs with fake devices too."""
    from accelerate import infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    max_memory = _check_max_memory(max_memory)
    if isinstance(device_map, dict):
        return _within_disk_budget(meta_model, check_map(meta_model, device_map), max_memory, dtype)
    strategy = validate.choice(device_map, STRATEGIES, name="device_map")
    no_split = no_split_classes(meta_model)
    if strategy != "sequential":
        # accelerate balances over torch devices ("disk" is none: torch.device("disk") raises); the disk budget
        # is set aside and given back to the planner unchanged
        disk = {k: v for k, v in (max_memory or {}).items() if k == "disk"}
        devices = None if max_memory is None else {k: v for k, v in max_memory.items() if k != "disk"}
        max_memory = get_balanced_memory(meta_model, max_memory=devices, no_split_module_classes=no_split,
                                         dtype=dtype, low_zero=strategy == "balanced_low_0")
        max_memory = {**max_memory, **disk}
    found = infer_auto_device_map(meta_model, max_memory=max_memory, no_split_module_classes=no_split, dtype=dtype)
    return _within_disk_budget(meta_model, check_map(meta_model, dict(found)), max_memory, dtype)


def _within_disk_budget(meta_model: nn.Module, mapping: DeviceMap, max_memory: dict | None,
                        dtype: torch.dtype) -> DeviceMap:
    """accelerate's planner treats disk as unlimited: a `max_memory["disk"]` budget the placement exceeds is
    refused at load, naming the bytes the disk entries hold (else every later run would be refused by the memory
    guard, advising to offload more)."""
    if not max_memory or "disk" not in max_memory:
        return mapping
    from accelerate.utils import compute_module_sizes, convert_file_size_to_int

    budget = convert_file_size_to_int(max_memory["disk"])
    sizes = compute_module_sizes(meta_model, dtype=dtype)
    on_disk = {name: sizes.get(name, 0) for name, dev in mapping.items() if dev == "disk"}
    need = sum(on_disk.values())
    if need > budget:
        from mdm_lens.hooks.memory import human

        raise ArgumentError(f"max_memory['disk']={max_memory['disk']!r} is exceeded: this placement puts "
                            f"{sorted(on_disk)} on disk ({human(need)}), more than the {human(budget)} allowed. Raise "
                            "the disk budget or the devices' budgets (max_memory) so fewer modules go to disk.",
                            argument="max_memory['disk']", value=max_memory["disk"],
                            allowed=f"at least {human(need)} for this placement")
    return mapping


def _check_max_memory(max_memory: Any) -> dict | None:
    return check_max_memory(max_memory, real=False)  # planning may name devices this machine lacks


def check_map(model: nn.Module, device_map: dict, real: bool = False) -> DeviceMap:
    """Every parameter covered by exactly one entry (longest prefix), tied weights on one device; `real`: every
    device exists on this machine (planning alone may name fake devices)."""
    out: DeviceMap = {}
    for name, dev in device_map.items():
        if not isinstance(name, str):
            raise ArgumentTypeError(f"device_map key {name!r} is invalid: expected a module name such as 'embed' or "
                                    "'blocks.3'.", argument="device_map", value=device_map, allowed="str keys")
        out[name] = _check_device(dev, name, real)
    modules = {n for n, _ in model.named_modules()}
    unknown = [n for n in out if n and n not in modules]
    if unknown:
        raise ArgumentError(f"device_map names modules this model does not have: {unknown}. Use names of "
                            "model.named_modules(), e.g. 'embed', 'blocks.0', 'ln_final', 'unembed' (or '' for all).",
                            argument="device_map", value=device_map, allowed="module names")
    missing = [p for p, _ in model.named_parameters(remove_duplicate=False) if target_of(p, out) is None]
    if missing:
        raise ArgumentError(f"device_map leaves {len(missing)} parameter(s) without a device, e.g. {missing[:4]}. "
                            "Name every top-level module (embed, blocks.N, ln_final, unembed) or use ''.",
                            argument="device_map", value=device_map, allowed="a map covering every parameter")
    if getattr(model.cfg, "tie_word_embeddings", False) and target_of("embed.W_E", out) != target_of(
            "unembed.weight", out):
        raise ArgumentError("device_map puts the tied embedding and unembedding on different devices "
                            f"({target_of('embed.W_E', out)!r} vs {target_of('unembed.weight', out)!r}); a tied "
                            "weight is one tensor: give 'embed' and 'unembed' the same device.",
                            argument="device_map", value=device_map, allowed="embed and unembed together")
    return _disjoint(model, out)


def _disjoint(model: nn.Module, device_map: DeviceMap) -> DeviceMap:
    """accelerate's dispatch wants entries that do not nest ({'': 'cpu', 'blocks.1': 'disk'} would place block 1
    twice): an entry with more specific entries below it is replaced by its children, each keeping its device."""
    out = dict(device_map)
    while nested := [n for n in out if any(o != n and (n == "" or o.startswith(n + ".")) for o in out)]:
        name = min(nested, key=len)
        dev = out.pop(name)
        module = model.get_submodule(name)
        if any(True for _ in module.parameters(recurse=False)):
            raise ArgumentError(f"device_map splits module {name!r}, which holds parameters of its own; map it "
                                "whole.", argument="device_map", value=device_map, allowed="whole modules")
        for child, _ in module.named_children():
            full = f"{name}.{child}" if name else child
            out.setdefault(full, dev)
    return out


def _check_device(dev: Any, name: str, real: bool) -> int | str:
    if isinstance(dev, torch.device):
        dev = str(dev)
    if isinstance(dev, bool) or not isinstance(dev, (int, str)):
        raise ArgumentTypeError(f"device_map[{name!r}]={validate.describe(dev)} is invalid: expected a GPU index, "
                                "'cpu', 'cuda:N' or 'disk'.", argument="device_map", value=dev,
                                allowed="int, 'cpu', 'cuda:N', 'disk'")
    if dev == "disk" or not real:
        return dev
    validate.device(f"cuda:{dev}" if isinstance(dev, int) else dev, name=f"device_map[{name!r}]")
    return dev


def target_of(param: str, device_map: DeviceMap) -> int | str | None:
    """The device of a parameter: the entry with the longest module-name prefix ('' covers everything)."""
    best, found = -1, None
    for name, dev in device_map.items():
        if (name == "" or param == name or param.startswith(name + ".")) and len(name) > best:
            best, found = len(name), dev
    return found


def main_device(device_map: DeviceMap) -> int | str:
    """Where the computation of offloaded ('cpu'/'disk') modules runs, as accelerate chooses it: the first
    accelerator in the map, else "cpu". In accelerate's own form (an int or a str): its `dispatch_model` compares
    it with the string "cpu", and a torch.device("cpu") would make it offload the resident CPU modules too."""
    for dev in device_map.values():
        if dev not in ("cpu", "disk"):
            return dev
    return "cpu"


class Placer:
    """Called per converted tensor: moves it to its device, or writes it to the disk offload and returns None, so
    no more than one tensor of a disk-bound block is ever in host memory."""

    def __init__(self, device_map: DeviceMap, offload_folder: Any, tied: bool, max_memory: dict | None = None):
        self.device_map, self.tied, self.index, self.max_memory = device_map, tied, {}, max_memory
        self.folder = None
        if "disk" in device_map.values():
            if offload_folder is None:
                raise ArgumentError("device_map sends some modules to 'disk' but offload_folder is not set: pass "
                                    "offload_folder=<a folder for the offloaded weights>.", argument="offload_folder",
                                    value=None, allowed="a folder path")
            if not isinstance(offload_folder, (str, os.PathLike)):
                raise ArgumentTypeError(f"offload_folder={validate.describe(offload_folder)} is invalid: expected a "
                                        "folder path.", argument="offload_folder", value=offload_folder,
                                        allowed="str or os.PathLike")
            self.folder = Path(offload_folder)
            self.folder.mkdir(parents=True, exist_ok=True)

    def __call__(self, name: str, tensor: Tensor) -> Tensor | None:
        dev = target_of(name, self.device_map)
        if dev != "disk":
            return tensor.to(f"cuda:{dev}" if isinstance(dev, int) else dev)
        from accelerate.utils import offload_weight

        offload_weight(tensor, name, str(self.folder), index=self.index)
        if self.tied and name == "embed.W_E":  # the unembed's hook looks its weight up under its own name
            offload_weight(tensor, "unembed.weight", str(self.folder), index=self.index)
        return None

    def finish(self) -> None:
        if self.folder is not None:
            from accelerate.utils import save_offload_index

            save_offload_index(self.index, str(self.folder))


def dispatch(model: nn.Module, device_map: DeviceMap, placer: Placer) -> None:
    """accelerate's `dispatch_model`: AlignDevicesHooks on the mapped modules (inputs moved to the module's
    execution device, disk weights loaded per call); `model.hf_device_map` records the map."""
    from accelerate import dispatch_model

    main = main_device(device_map)
    folder = str(placer.folder) if placer.folder is not None else None
    # buffers (the MoE routers' expert_bias) follow their module to disk like its parameters
    dispatch_model(model, device_map=device_map, main_device=main, offload_dir=folder, offload_buffers=True)
    model.hf_device_map = dict(device_map)
    model.max_memory = placer.max_memory  # the budgets memory_plan / generate check a run against
    model.cfg.device = torch.device(f"cuda:{main}" if isinstance(main, int) else main)


def execution_device(module: nn.Module, fallback: Callable[[], torch.device]) -> torch.device:
    """Where `module` computes: its accelerate hook's execution device (offloaded weights sit on meta), else
    where its weights are."""
    hook = getattr(module, "_hf_hook", None)
    dev = getattr(hook, "execution_device", None)
    if dev is None:
        return fallback()
    return torch.device(f"cuda:{dev}" if isinstance(dev, int) else dev)


def devices_of(model: nn.Module) -> dict[str, list[str]]:
    """Device name → the mapped modules on it (from `hf_device_map`), for tables and reprs."""
    out: dict[str, list[str]] = {}
    for name, dev in (getattr(model, "hf_device_map", None) or {"": str(model.cfg.device)}).items():
        out.setdefault(str(dev), []).append(name)
    return out


def prepare(meta_model: nn.Module, device_map: Any, max_memory: Any, n_devices: Any, offload_folder: Any,
            dtype: torch.dtype, device: torch.device = torch.device("cpu")) -> Placer | None:
    """None for a one-device load (no map, `n_devices` None or 1); else the Placer for `build_state_dict`, with
    the planned map in `placer.device_map`. All arguments are checked here, before any tensor is read."""
    device_map = plain_device_map(device_map)  # "cpu" / "cuda:1" as transformers reads it: {"": device}
    max_memory = check_max_memory(max_memory, real=True)
    if n_devices is not None and validate.integer(n_devices, name="n_devices", min=1) > 1:
        max_memory = n_devices_memory(n_devices, max_memory)
        device_map = "balanced" if device_map is None else device_map
    if device_map is None:
        if max_memory is not None or offload_folder is not None:
            which = "max_memory" if max_memory is not None else "offload_folder"
            raise ArgumentError(f"{which}= only applies with device_map= (or n_devices>1); pass device_map='auto'.",
                                argument=which, value=max_memory if which == "max_memory" else offload_folder,
                                allowed="use together with device_map")
        return None
    if device.type != "cpu":
        raise ArgumentError(f"device={str(device)!r} and device_map= were both given: the map places every module; "
                            "pass one of them.", argument="device", value=str(device), allowed="'cpu' (the default) "
                            "with device_map")
    planned = check_map(meta_model, plan(meta_model, device_map, max_memory, dtype), real=True)
    return Placer(planned, offload_folder, tied=bool(meta_model.cfg.tie_word_embeddings),
                  max_memory=_check_max_memory(max_memory))


def finish(model: nn.Module, state: dict[str, Tensor], placer: Placer) -> None:
    """Assign the resident tensors, leave disk-offloaded ones on meta, write the offload index, dispatch."""
    placer.finish()
    if model.cfg.tie_word_embeddings and "embed.W_E" in state:
        state["unembed.weight"] = state["embed.W_E"]
    result = model.load_state_dict(state, strict=False, assign=True)
    on_disk = {k for k in placer.index}
    left = sorted(set(result.missing_keys) - on_disk)
    if left or result.unexpected_keys:  # build_state_dict checked the names: this would be our bug
        raise ConfigError(f"placement left parameters unassigned {left} or unexpected {result.unexpected_keys}.")
    if model.cfg.tie_word_embeddings:
        model.unembed.weight = model.embed.W_E
    dispatch(model, placer.device_map, placer)


def bridge_refuses(**options: Any) -> None:
    """The bridge takes `device_map` (transformers places the modules) but not these yet: refused, not ignored."""
    given = [k for k, v in options.items() if v is not None]
    if given:
        raise ConfigError(f"{', '.join(given)} apply to HookedMDM checkpoints; this checkpoint loads into the "
                          "transformers-native bridge, which takes device_map= only.")
