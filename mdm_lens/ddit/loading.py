"""Loading MDLM (`kuleshov-group/mdlm-owt`) and Duo (`s-sahoo/duo`, `duo-distilled`) from their hub layouts.

The family is read from config.json (`model_type` "mdlm"/"duo", or `architectures` ["MDLM"]/["DUO"]); keys the file
lacks take the hub config class's defaults (`ddit/config.py`). Weights are `backbone.` + the DDiT names, read from
model.safetensors or pytorch_model.bin (`torch.load(weights_only=True)`); nothing from the checkpoint runs."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

import torch

from mdm_lens import validate
from mdm_lens.config import MDMConfig
from mdm_lens.ddit.config import DDIT_FAMILIES, DEFAULTS, check_mask_key, ddit_config
from mdm_lens.errors import ArgumentTypeError, CheckpointError, ConfigError
from mdm_lens.loading.readers import refuse_non_floating
from mdm_lens.loading.values import SCHEMAS, check_raw

ARCHITECTURES = {"MDLM": "mdlm", "DUO": "duo"}
PLACEMENT = ("device_map", "max_memory", "n_devices", "offload_folder")  # as HookedMDM.from_pretrained
MODEL_TYPES = {"mdlm": "mdlm", "duo": "duo"}


# every research family's names, so that a config naming two of them (model_type "mdlm", architectures ["DUO"]) is
# refused by whichever loader looks first, instead of loading as the one that loader checks first
RESEARCH_ARCHITECTURES = {**ARCHITECTURES, "BD3LM": "bd3lm", "DIT": "gidd"}
RESEARCH_MODEL_TYPES = {**MODEL_TYPES, "bd3lm": "bd3lm", "dit": "gidd"}


def research_family(raw: dict[str, Any], path: Any = "config.json") -> str | None:
    """The one research family (mdlm / duo / bd3lm / gidd) config.json's `model_type` and `architectures` name, or
    None; a ConfigError when they name two (the reference's loader would build one class and read the other's
    weights: which one is meant cannot be told)."""
    archs = raw.get("architectures") or []
    named = {RESEARCH_ARCHITECTURES[a] for a in archs if isinstance(a, str) and a in RESEARCH_ARCHITECTURES}
    by_type = RESEARCH_MODEL_TYPES.get(str(raw.get("model_type", "")).lower())
    families = named | ({by_type} if by_type else set())
    if len(families) > 1:
        raise ConfigError(f"{path}: model_type={raw.get('model_type')!r} and architectures={archs!r} name different "
                          f"families ({', '.join(sorted(families))}); make them agree.")
    return families.pop() if families else None


def ddit_family(raw: dict[str, Any], path: Any = "config.json") -> str | None:
    family = research_family(raw, path)
    return family if family in DDIT_FAMILIES else None


def folder_family(folder: Path) -> str | None:
    """The DDiT family a checkpoint folder holds, or None (another family, or no readable config.json)."""
    try:
        raw = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return ddit_family(raw, Path(folder) / "config.json") if isinstance(raw, dict) else None


def config_from_ddit(raw: dict[str, Any], family: str, name: str, path: Path) -> MDMConfig:
    check_raw(raw, SCHEMAS[family], path)
    v = {**DEFAULTS[family], **{k: raw[k] for k in DEFAULTS[family] if k in raw}}
    if v.get("causal"):
        raise ConfigError(f"{path}: causal=true is Duo's autoregressive baseline (no adaLN, causal attention), not a "
                          "diffusion model; it is not supported.")
    if v["hidden_dim"] % v["n_heads"] or (v["hidden_dim"] // v["n_heads"]) % 2:
        raise ConfigError(f"{path}: hidden_dim={v['hidden_dim']} must split into n_heads={v['n_heads']} heads of an "
                          "even size (rotary).")
    # Duo's network is always time-conditioned (its trainer passes σ = −log α_t); MDLM reads the key
    tc = v["time_conditioning"] if family == "mdlm" else True
    cfg = ddit_config(family, d_vocab=v["vocab_size"], n_ctx=v["model_length"], d_model=v["hidden_dim"],
                      cond_dim=v["cond_dim"], n_layers=v["n_blocks"], n_heads=v["n_heads"], time_conditioning=tc,
                      model_name=name, dropout=v["dropout"])
    check_mask_key(raw, cfg, path)
    return cfg


def ddit_plan(cfg: MDMConfig) -> dict[str, str]:
    """Our parameter name → the hub's (`backbone.` + the reference module names, families-2.md §1.1)."""
    plan = {"embed.W_E": "vocab_embed.embedding", "time_embed.fc1.weight": "sigma_map.mlp.0.weight",
            "time_embed.fc1.bias": "sigma_map.mlp.0.bias", "time_embed.fc2.weight": "sigma_map.mlp.2.weight",
            "time_embed.fc2.bias": "sigma_map.mlp.2.bias", "ln_final.w": "output_layer.norm_final.weight",
            "unembed.weight": "output_layer.linear.weight", "unembed.bias": "output_layer.linear.bias",
            "final_adaLN.linear.weight": "output_layer.adaLN_modulation.weight",
            "final_adaLN.linear.bias": "output_layer.adaLN_modulation.bias"}
    for i in range(cfg.n_layers):
        b = f"blocks.{i}."
        plan.update({b + "ln1.w": b + "norm1.weight", b + "ln2.w": b + "norm2.weight",
                     b + "attn.qkv.weight": b + "attn_qkv.weight", b + "attn.out.weight": b + "attn_out.weight",
                     b + "mlp.fc_in.weight": b + "mlp.0.weight", b + "mlp.fc_in.bias": b + "mlp.0.bias",
                     b + "mlp.fc_out.weight": b + "mlp.2.weight", b + "mlp.fc_out.bias": b + "mlp.2.bias",
                     b + "adaLN.linear.weight": b + "adaLN_modulation.weight",
                     b + "adaLN.linear.bias": b + "adaLN_modulation.bias"})
    return {ours: "backbone." + theirs for ours, theirs in plan.items()}


def load_ddit(cls: type, name_or_path: str | os.PathLike, *, dtype: Any = torch.float32, device: Any = "cpu",
              allow_download: bool = False, load_tokenizer: bool = True, autocast: bool = False, device_map: Any = None,
              max_memory: Any = None, n_devices: Any = None, offload_folder: Any = None, **options: Any) -> Any:
    """`HookedDDiT.from_pretrained` (and its subclasses'): MDLM / Duo into `HookedDDiT`, a BD3LM or GIDD folder into
    `HookedBD3LM` / `HookedGIDD` (`mdm_lens.ddit.hub`; `HookedDDiT.from_pretrained` picks the class, a subclass
    loads its own family only); `autocast=True` turns on the bf16 autocast-faithful path (`set_autocast`).
    `device_map` / `max_memory` / `n_devices` / `offload_folder` place the model as `HookedMDM.from_pretrained`
    does (`load_weights`). Weight processing (`fold_ln`, …) is refused before any weight is read."""
    from mdm_lens.ddit.unsupported import PROCESSING_KEYWORDS, refuse_processing
    from mdm_lens.loading.readers import CheckpointReader
    from mdm_lens.loading.resolve import load_tokenizer as read_tokenizer
    from mdm_lens.loading.resolve import resolve

    accepted = f"dtype, device, allow_download, load_tokenizer, autocast, {', '.join(PLACEMENT)}"
    unknown = sorted(k for k in options if k not in PROCESSING_KEYWORDS)
    if unknown:
        raise ArgumentTypeError(f"from_pretrained got {unknown}: DDiT checkpoints take {accepted}.",
                                argument=unknown[0], value=options, allowed=accepted)
    autocast = validate.boolean(autocast, name="autocast")
    dtype, device = _dtype(dtype), validate.device(device, name="device")
    folder, known = resolve(name_or_path, allow_download=validate.boolean(allow_download, name="allow_download"))
    from mdm_lens.loading.config_json import read_config_json

    path = folder / "config.json"
    raw = read_config_json(folder)
    family = research_family(raw, path)
    if family is not None:
        refuse_processing(options, family)  # before any weight is read
    target = family_class(cls, family)
    if target is None or not issubclass(target, cls):
        raise ConfigError(_wrong_class(path, raw, family, cls, target))
    name = known.name if known else str(name_or_path)
    if family not in DDIT_FAMILIES:  # BD3LM / GIDD: their class's own loader (hub layouts, `mdm_lens.ddit.hub`)
        return target.load_family(folder, family, name, dtype=dtype, device=device, load_tokenizer=load_tokenizer,
                                  autocast=autocast, device_map=device_map, max_memory=max_memory,
                                  n_devices=n_devices, offload_folder=offload_folder)
    cfg = config_from_ddit(raw, family, name, path)
    cfg.dtype, cfg.device = dtype, device
    with torch.device("meta"):
        model = cls(cfg)
    load_weights(model, CheckpointReader(folder), ddit_plan(cfg), dict(device_map=device_map, max_memory=max_memory,
                                                                      n_devices=n_devices, offload_folder=offload_folder))
    if validate.boolean(load_tokenizer, name="load_tokenizer"):
        model.tokenizer = read_tokenizer(folder)
    return model.set_autocast(autocast).eval()


def family_class(cls: type, family: str | None) -> type | None:
    """The class a research family loads into: `cls` itself when it (or a base) lists the family in `families`, else
    the subclass of `cls` that does (HookedDDiT → HookedBD3LM / HookedGIDD, which `mdm_lens.ddit` imports with the
    package), else the one anywhere under the DDiT root (for the error naming it); None: not a DDiT family. Found
    through the class tree, so this module imports none of the model classes."""
    if family is None:
        return None
    if family in getattr(cls, "families", ()):
        return cls
    roots = [c for c in cls.__mro__ if "families" in vars(c)]
    for stack in (list(cls.__subclasses__()), roots[-1:]):
        while stack:
            c = stack.pop(0)
            if family in vars(c).get("families", ()):
                return c
            stack.extend(c.__subclasses__())
    return None


def _wrong_class(path: Path, raw: dict[str, Any], family: str | None, cls: type, target: type | None) -> str:
    if target is None:
        return (f"{path}: model_type={raw.get('model_type')!r} is not a DDiT family (mdlm, duo, bd3lm, gidd); "
                "HookedMDM.from_pretrained(folder) loads every supported family into its class.")
    return (f"{path} holds a {family} checkpoint, which loads into {target.__name__}, not {cls.__name__}: use "
            f"{target.__name__}.from_pretrained(folder) or HookedMDM.from_pretrained(folder) (which picks the class); "
            "autocast=True is accepted there (or call model.set_autocast(True) after loading).")


def _dtype(dtype: Any) -> torch.dtype:
    """A floating torch dtype or its torch name ("float32", "bfloat16"); `HookedMDM.from_pretrained` accepts the
    wider list of aliases and passes a torch.dtype here."""
    value = getattr(torch, dtype.strip().removeprefix("torch."), None) if isinstance(dtype, str) else dtype
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ArgumentTypeError(f"dtype={validate.describe(dtype)} is invalid: expected a floating torch dtype.",
                                argument="dtype", value=dtype, allowed="torch.float32, torch.bfloat16, ...")
    return value


def load_weights(model: Any, reader: Any, plan: dict[str, str], placement_options: dict[str, Any]) -> None:
    """Read the checkpoint into `model` (built on meta, `cfg.dtype` / `cfg.device` set): on one device, or placed
    by the shared planner (`mdm_lens.loading.placement`: accelerate's map with the DDiT blocks as no-split units,
    disk offload, `dispatch_model`) when a device map, `n_devices` > 1, `max_memory` or `offload_folder` is given.
    Either way `model.hf_device_map` says where each module lives."""
    import mdm_lens.loading.placement as placement  # the module, not the package (which imports this one)

    cfg = model.cfg
    placer = placement.prepare(model, placement_options["device_map"], placement_options["max_memory"],
                               placement_options["n_devices"], placement_options["offload_folder"], cfg.dtype,
                               torch.device(cfg.device))  # every option checked before a tensor is read
    if placer is None:
        state = read_state(reader, plan, model, cfg)
        model.load_state_dict({k: t.to(device=cfg.device, dtype=cfg.dtype) for k, t in state.items()}, strict=True,
                              assign=True)
        model.hf_device_map = {"": str(cfg.device)}  # one device: the attribute a dispatched model has
        return
    place = lambda name, t: placer(name, t.to(dtype=cfg.dtype))  # noqa: E731
    placement.finish(model, read_state(reader, plan, model, cfg, place=place), placer)
    from mdm_lens.offload_checks import mark_offloaded

    mark_offloaded(model)  # weight views of an offloaded module name it in their error


def read_state(reader: Any, plan: dict[str, str], model: Any, cfg: MDMConfig,
               place: Callable[[str, torch.Tensor], torch.Tensor | None] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor the plan names, with the shape our model expects; an unknown key is an error (a layout this
    loader does not understand must not load silently). `rotary_emb.inv_freq` must equal the fp32 formula.
    `place` (a `placement.Placer` call) puts each tensor on its device as it is read; a disk-bound one is written
    to the offload folder and left out, so a disk block is never whole in host memory."""
    keys = set(reader.keys())
    inv = "backbone.rotary_emb.inv_freq"
    missing, extra = sorted(set(plan.values()) - keys), sorted(keys - set(plan.values()) - {inv})
    if missing or extra:
        raise CheckpointError(f"{reader.folder}: the weights do not match a {cfg.family} layout with n_blocks="
                              f"{cfg.n_layers}: missing {missing[:6]}{'…' if len(missing) > 6 else ''}, unexpected "
                              f"{extra[:6]}{'…' if len(extra) > 6 else ''}.")
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    refuse_non_floating(reader, sorted(plan.values()))
    out = {}
    for ours, theirs in plan.items():
        if reader.shape(theirs) != expected[ours]:
            raise CheckpointError(f"{reader.folder}: {theirs} has shape {reader.shape(theirs)}, expected "
                                  f"{expected[ours]} from config.json (hidden_dim, cond_dim, vocab_size, n_heads).")
        t = reader.get(theirs)
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise CheckpointError(f"{reader.folder}: {theirs} holds NaN or inf values; the checkpoint is corrupt.")
        if place is None:
            out[ours] = t
        elif (placed := place(ours, t)) is not None:
            out[ours] = placed
        del t
    if inv in keys:
        d = cfg.d_head
        want = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
        got = reader.get(inv).float()
        if got.shape != want.shape or not torch.allclose(got, want, rtol=1e-2):
            raise CheckpointError(f"{reader.folder}: {inv} does not hold the base-10000 frequencies of head size {d}; "
                                  "config.json's hidden_dim / n_heads disagree with the weights.")
    return out
