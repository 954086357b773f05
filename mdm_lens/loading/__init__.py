"""`from_pretrained`: resolve a name or path, read `config.json`, convert the weights, check them.

Resolution order: a shipped zoo model → a local folder → a Hugging Face hub id found in the local HF
cache (downloads only when `allow_download=True` and offline mode is off). Nothing from a checkpoint is
ever executed: `auto_map`/remote code is ignored, tensors come from safetensors or
`torch.load(weights_only=True)`.
"""

from __future__ import annotations

import re
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from mdm_lens.config import MDMConfig
from mdm_lens import validate
from mdm_lens.loading.config_json import read_config_json  # noqa: F401  (public here too)
from mdm_lens.errors import ArgumentError, ArgumentTypeError, CheckpointError, ConfigError
from mdm_lens.offload_checks import mark_offloaded, require_resident
from mdm_lens.loading.dreamon import apply_dreamon_tokens
from mdm_lens.loading.diagnose import causes, listing, mismatch_report
from mdm_lens.loading.dispatch import supported_names
from mdm_lens.loading.families import family_config, family_of, family_plan
from mdm_lens.loading.fastdllm_v2 import config_from_fastdllm_v2, is_fastdllm_v2
from mdm_lens.loading.hf import config_from_hf, hf_family, hf_plan
from mdm_lens.loading.llada import config_from_llada, is_llada, llada_plan
from mdm_lens.loading.native import check_native_extra, check_native_raw
from mdm_lens.loading import placement
from mdm_lens.loading.plan import Plan, source_shapes
from mdm_lens.loading.readers import CheckpointReader, refuse_non_floating
from mdm_lens.loading.registry import FAMILY_DEFAULTS, KNOWN_MODELS, KnownModel, lookup  # noqa: F401 (re-export)
# name resolution and the tokenizer file live one level down (shared with the bridge); re-exported here
from mdm_lens.loading.resolve import ZOO_DIR, ZOO_ORG, resolve  # noqa: F401
from mdm_lens.loading.resolve import load_tokenizer as _load_tokenizer
from mdm_lens.loading.special import apply_special_tokens
from mdm_lens.qk_attention import FAMILY_ARCHES
from mdm_lens.loading.values import SCHEMAS, check_ids_in_vocab, check_raw


def _missing_or_malformed(e: Exception, raw: dict, path: Path) -> ConfigError:
    """Say "lacks the required key" when the error is a key the file does not have (a KeyError from a converter,
    or MDMConfig's missing-argument TypeError), not "wrong type", which would send the user to the wrong key."""
    missing = re.findall(r"'(\w+)'", str(e)) if isinstance(e, TypeError) and "required" in str(e) else (
        [e.args[0]] if isinstance(e, KeyError) and e.args and e.args[0] not in raw else [])
    if missing:
        return ConfigError(f"{path} lacks the required key{'s' if len(missing) > 1 else ''} "
                           f"{', '.join(map(str, missing))}: add it to config.json.")
    return ConfigError(f"{path} has a setting of the wrong type or form ({type(e).__name__}: {e}).")


#: MDMConfig's size fields and the HF config.json keys they are read from
_SIZE_KEYS = {"d_model": "hidden_size", "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads",
              "d_head": "head_dim", "d_mlp": "intermediate_size", "n_layers": "num_hidden_layers",
              "d_vocab": "vocab_size"}


def _defaulted_sizes(raw: dict, message: str) -> str:
    """The size keys an HF config.json leaves out, among those the error names: the loader took the reference
    class's defaults for them, so a size in the error may be one the file never holds (n_kv_heads=32 from Qwen3's
    default)."""
    if raw.get("model_type") == "mdm_lens":
        return ""
    absent = [key for field, key in _SIZE_KEYS.items() if f"{field}=" in message and key not in raw]
    return (f" config.json does not set {', '.join(absent)}: the reference config class's default was used; set "
            "it in config.json.") if absent else ""


def read_config(folder: Path, name: str, known: KnownModel | None) -> tuple[MDMConfig, str]:
    path = folder / "config.json"
    raw = read_config_json(folder)
    try:
        if raw.get("model_type") == "mdm_lens":
            check_native_raw(raw, path)
            cfg, family = MDMConfig.from_dict({k: v for k, v in raw.items() if k != "model_type"}), "mdm_lens"
            check_native_extra(cfg, path)
        else:
            family = _family(raw, path)
            # every value a converter reads is type/range-checked first (loading/values.py), whatever the family
            check_raw(raw, SCHEMAS[family], path)
            cfg = _convert(raw, family, name, folder)
        check_ids_in_vocab(raw, cfg.d_vocab, path)
    except (TypeError, KeyError) as e:  # a missing key, or a value of the wrong JSON type (e.g. "n_heads": "32")
        raise _missing_or_malformed(e, raw, path) from e
    except ConfigError as e:  # MDMConfig's own checks name the field; say which file it came from
        if str(path) in str(e):
            raise
        raise ConfigError(f"{path}: {e}{_defaulted_sizes(raw, str(e))}") from e
    _apply_registry_facts(cfg, known, family)
    apply_special_tokens(cfg, folder, raw, family, known)
    apply_dreamon_tokens(cfg, folder, family)  # after EOS: DreamOn deletes at the tokenizer's EOS
    if cfg.attention != "causal":  # a diffusion model whose mask is its EOS: every EOS stop fires on the masks
        validate.distinct_ids({"mask_token_id": cfg.mask_token_id, "eos_token_id": cfg.eos_token_id},
                              why="the samplers' EOS stop would fire on the canvas's own masks and the answer would "
                                  "keep mask ids as if they came after the EOS.", error=ConfigError)
    if family == "rnd1":  # its sampler freezes pad positions (never maskable): pad = mask freezes the whole answer
        validate.distinct_ids({"mask_token_id": cfg.mask_token_id, "pad_token_id": cfg.pad_token_id},
                              why=f"{path}: RND1's sampler never unmasks a position holding the pad id, so no "
                                  "position would be maskable.", error=ConfigError)
    return cfg, family


def _family(raw: dict[str, Any], path: Path) -> str:
    family = family_of(raw)  # LLaDA2.x, LLaDA-MoE (model_type "llada"!), SDAR, SDAR-MoE
    if family is None and is_fastdllm_v2(raw):  # Qwen2 weights, block-causal attention
        family = "fastdllm_v2"
    if family is None and is_llada(raw):
        family = "llada"
    family = family or hf_family(raw)
    if family is None:
        raise ConfigError(f"{path}: architectures={raw.get('architectures')} model_type="
                          f"{raw.get('model_type')!r} is not a supported family (supported: {supported_names()}).")
    return family


def _convert(raw: dict[str, Any], family: str, name: str, folder: Path) -> MDMConfig:
    if family_of(raw) is not None:
        return family_config(raw, family, name, folder)
    if family == "fastdllm_v2":
        return config_from_fastdllm_v2(raw, name, folder)
    if family == "llada":
        return config_from_llada(raw, name)
    return config_from_hf(raw, family, name)


def _apply_registry_facts(cfg: MDMConfig, known: KnownModel | None, family: str) -> None:
    """Mask/bos/pad ids config.json lacks: the registry entry, else the family's reference constants; an id
    outside this checkpoint's vocabulary is not used (the constants belong to the released vocabularies)."""
    facts = dict(FAMILY_DEFAULTS.get(family, {}))
    if known is not None:
        facts.update(mask_token_id=known.mask_token_id, bos_token_id=known.bos_token_id,
                     pad_token_id=known.pad_token_id)
        cfg.extra["special_tokens"] = dict(known.special)
    for key, value in facts.items():
        if getattr(cfg, key) is None and value is not None and 0 <= value < cfg.d_vocab:
            setattr(cfg, key, value)
    cfg.extra.setdefault("prepend_bos", family == "llama")


def native_plan(cfg: MDMConfig, names: list[str]) -> Plan:
    """Our own format stores each parameter under its own name (`names`: the model's state_dict keys)."""
    return {n: [n] for n in names if not (cfg.tie_word_embeddings and n == "unembed.weight")}


def build_state_dict(plan: Plan, reader: CheckpointReader, expected: dict[str, tuple[int, ...]],
                     source_shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, device: str | torch.device,
                     tied_hint: str = "", cause: str = "", place: Any = None) -> dict[str, torch.Tensor]:
    """Check every source tensor is present with the right shape, then assemble (cat) and cast. `cause` names
    the config keys the tensor names contradict (loading/diagnose.py); every wrong name is listed. `place`
    (a `placement.Placer`) puts each tensor on its mapped device as it is read; disk-bound ones are omitted."""
    keys = set(reader.keys())
    wanted = {src for sources in plan.values() for src in sources}
    missing = sorted(wanted - keys)
    extra = sorted(k for k in keys - wanted if not k.endswith("inv_freq"))
    if missing or extra:
        raise CheckpointError(mismatch_report(reader.folder, missing, extra, cause)
                              + (tied_hint if any(_is_unembed(k) for k in missing + extra) else ""))
    wrong = {src: (reader.shape(src), want) for src, want in source_shapes.items() if reader.shape(src) != want}
    if wrong:  # checked from the file headers before any tensor is read
        shown = [f"{src} has shape {got}, expected {want}" for src, (got, want) in wrong.items()]
        raise CheckpointError(
            f"shape mismatch in {reader.folder}: {listing('misshapen', shown, reader.folder)}. config.json and the "
            "weights disagree (d_model, heads, kv heads, head size, d_mlp or vocab size), or the tensor is corrupt."
        )
    refuse_non_floating(reader, sorted(wanted))  # from the headers too, before any tensor is read
    out = {}
    for target, sources in plan.items():
        parts = [reader.get(src) for src in sources]
        tensor = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)  # the shapes were checked above
        if tensor.is_floating_point() and not _all_finite(tensor):
            bad = [s for s, p in zip(sources, parts) if p.is_floating_point() and not _all_finite(p)]
            raise CheckpointError(f"tensor(s) {bad} in {reader.folder} hold NaN or inf values: the checkpoint is "
                                  "corrupt (or was saved after a diverged update); fetch it again.")
        if place is None:
            out[target] = tensor.to(device=device, dtype=dtype)
        elif (placed := place(target, tensor.to(dtype=dtype))) is not None:
            out[target] = placed
        del parts, tensor  # a disk-bound tensor is freed now, not when the next one is read (peak host memory)
    return out


def _all_finite(tensor: torch.Tensor, chunk: int = 1 << 22) -> bool:
    """`isfinite(t).all()` a few million elements at a time: the whole-tensor bool mask was a transient of a
    quarter of the tensor's bytes on the host, kept by the allocator afterwards (peak RSS while loading)."""
    flat = tensor.reshape(-1)
    return all(bool(torch.isfinite(part).all()) for part in flat.split(chunk))


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32, "float16": torch.float16,
           "fp16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float64": torch.float64, "fp64": torch.float64, "double": torch.float64}


def parse_dtype(dtype: Any) -> torch.dtype:
    """A floating torch dtype, or its name ("float32", "bfloat16", "bf16", …)."""
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ArgumentError(f"dtype={dtype} is invalid: expected a floating dtype (float32, bfloat16, float16, "
                                "float64).", argument="dtype", value=dtype, allowed="a floating torch dtype")
        return dtype
    if isinstance(dtype, str):
        key = dtype.strip().lower().removeprefix("torch.")
        if key in _DTYPES:
            return _DTYPES[key]
        return validate.choice(dtype, list(_DTYPES), name="dtype")  # raises, listing the names
    raise ArgumentTypeError(f"dtype={validate.describe(dtype)} is invalid: expected a torch.dtype or one of "
                            f"{', '.join(map(repr, _DTYPES))}.", argument="dtype", value=dtype,
                            allowed="a torch.dtype or a dtype name")


def parse_device(device: Any) -> torch.device:
    if not isinstance(device, (str, torch.device)) or isinstance(device, bool):
        raise ArgumentTypeError(f"device={validate.describe(device)} is invalid: expected a str such as 'cpu' or "
                                "'cuda:0', or a torch.device.", argument="device", value=device,
                                allowed="a str or torch.device")
    try:
        torch.device(device)
    except (RuntimeError, ValueError) as e:
        raise ArgumentError(f"device={device!r} is invalid: expected a torch device string such as 'cpu', 'cuda' "
                            f"or 'cuda:0' ({e}).", argument="device", value=device, allowed="a torch device") from e
    if torch.device(device).type == "meta":  # a model with no weight values: every forward would fail inside torch
        raise ArgumentError(f"device={device!r} is invalid: a 'meta' model holds shapes but no weight values, so no "
                            "forward can run; load on 'cpu' or 'cuda' (device_map='auto' with offloading for models "
                            "larger than memory).", argument="device", value=device, allowed="'cpu', 'cuda', 'cuda:N'")
    return validate.device(device, name="device")  # "cuda" without CUDA: a typed error, not torch's assertion


def _is_unembed(key: str) -> bool:
    return key in ("lm_head.weight", "model.transformer.ff_out.weight", "transformer.ff_out.weight",
                   "unembed.weight")


def load_pretrained(cls: type, name_or_path: str | os.PathLike, *, dtype: torch.dtype | str = torch.float32,
                    device: str | torch.device | None = None, allow_download: bool = False,
                    load_tokenizer: bool = True, device_map: Any = None, max_memory: Any = None,
                    n_devices: Any = None, offload_folder: Any = None, processing: dict[str, bool] | None = None) -> Any:
    """The model of a checkpoint, in the class its family loads into. `processing` (the weight-processing flags the
    caller will apply after loading) is refused here, before any weight is read, for the classes that have no
    weight processing (the DDiT research models, the transformers-native bridge)."""
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise ArgumentTypeError(f"name_or_path={validate.describe(name_or_path)} is invalid: expected a str or a "
                                "path (a checkpoint folder, a hub id or a zoo name).", argument="name_or_path",
                                value=name_or_path, allowed="a str or os.PathLike")
    dtype = parse_dtype(dtype)
    if device is not None and (device_map is not None or n_devices not in (None, 1)):
        # an explicit device (cpu included: None is the default) beside a map: the map places every module
        raise ArgumentError(f"device={str(device)!r} and {'device_map' if device_map is not None else 'n_devices'}= "
                            "were both given: the map places every module, so device would be ignored; pass one of "
                            "them (device_map={'': 'cuda:0'} puts everything on one device).", argument="device",
                            value=str(device), allowed="device, or device_map / n_devices, not both")
    device = parse_device("cpu" if device is None else device)
    allow_download = validate.boolean(allow_download, name="allow_download")
    load_tokenizer = validate.boolean(load_tokenizer, name="load_tokenizer")
    folder, known = resolve(name_or_path, allow_download=allow_download)
    from mdm_lens.bridge.loading import bridged_architecture, load_bridge
    from mdm_lens.ddit.hub import hub_family
    from mdm_lens.ddit.loading import folder_family

    asked = {k: v for k, v in (processing or {}).items() if v}
    if asked and (hub_family(folder) or folder_family(folder)):
        from mdm_lens.ddit.unsupported import refuse_processing

        refuse_processing(asked, hub_family(folder) or folder_family(folder))
    if asked and bridged_architecture(folder):
        flag = next(iter(asked))
        raise ArgumentError(f"from_pretrained(..., {flag}=True) on a transformers-native checkpoint: the bridge runs "
                            "transformers' own norms and heads, so TL's weight processing is not implemented for it. "
                            "Load without it.", argument=flag, value=True, allowed="False (or leave it out)")
    if bridged_architecture(folder):  # transformers-native families (DiffusionGemma) load into the bridge
        from mdm_lens.bridge import TransformersBridge

        placement.bridge_refuses(max_memory=max_memory, n_devices=n_devices, offload_folder=offload_folder)

        return load_bridge(TransformersBridge, str(folder), dtype=dtype, device=device, device_map=device_map,
                           load_tokenizer=load_tokenizer)
    # the DDiT research models are placed by the same planner (ddit.loading.load_weights → placement)
    placing = dict(device_map=device_map, max_memory=max_memory, n_devices=n_devices, offload_folder=offload_folder)
    if hub_family(folder) is not None:  # BD3LM / GIDD-DiT (mdm_lens.ddit.hub)
        from mdm_lens.ddit.hub import load_hub
        from mdm_lens.ddit.loading import family_class
        from mdm_lens.ddit.model import HookedDDiT

        family = hub_family(folder)
        return load_hub(family_class(HookedDDiT, family), folder, family, known.name if known else str(name_or_path),
                        dtype=dtype, device=device, load_tokenizer=load_tokenizer, **placing)
    if folder_family(folder) is not None:  # MDLM / Duo load into HookedDDiT (mdm_lens.ddit)
        from mdm_lens.ddit.loading import load_ddit
        from mdm_lens.ddit.model import HookedDDiT

        return load_ddit(HookedDDiT, folder, dtype=dtype, device=device, load_tokenizer=load_tokenizer, **placing)
    name = known.name if known else str(name_or_path)
    cfg, family = read_config(folder, name, known)
    cfg.dtype, cfg.device = dtype, device
    reader = CheckpointReader(folder)
    with torch.device("meta"):
        model = cls(cfg)
    placer = placement.prepare(model, device_map, max_memory, n_devices, offload_folder, dtype, device)  # checked first
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if family == "mdm_lens":
        plan = native_plan(cfg, list(expected))
    else:
        plans = {"llada": llada_plan, **dict.fromkeys(FAMILY_ARCHES, family_plan)}
        plan = plans.get(family, hf_plan)(cfg, reader.keys())
    raw = read_config_json(folder)  # read_config checked it; the diagnosis reads which keys it names
    state = build_state_dict(plan, reader, expected, source_shapes(cfg, plan, expected), dtype, device,
                             tied_hint=_tying_hint(cfg, family, folder), cause=causes(cfg, family, raw, reader.keys()),
                             place=placer)
    if placer is not None:
        placement.finish(model, state, placer)
        mark_offloaded(model)  # weight views of an offloaded module name it in their error
    elif cfg.tie_word_embeddings:
        state["unembed.weight"] = state["embed.W_E"]
        model.load_state_dict(state, strict=True, assign=True)
        model.unembed.weight = model.embed.W_E
    else:
        model.load_state_dict(state, strict=True, assign=True)
    if placer is None:
        model.hf_device_map = {"": str(device)}  # one device: the same attribute a dispatched model has
    if load_tokenizer:
        from mdm_lens.chat import read_chat_template  # chat reads the tokenizer files with loading.special

        model.tokenizer = _load_tokenizer(folder)
        model.chat_template = read_chat_template(folder)
    return model.eval()


def _tying_hint(cfg: MDMConfig, family: str, folder: Path) -> str:
    key = {"llada": "weight_tying"}.get(family, "tie_word_embeddings")
    state = "tied" if cfg.tie_word_embeddings else "untied"
    return (f" The config says the unembedding is {state} ({key}={cfg.tie_word_embeddings}; an absent key takes the "
            f"reference default); if the weights disagree, set {key} in {folder / 'config.json'}.")


def save_pretrained(model: Any, folder: str | os.PathLike) -> Path:
    """Write a model in mdm_lens' own format: config.json (`model_type: mdm_lens`) + model.safetensors.

    Unprocessed models only: a processed one (`process_weights_`) has no norm weights and may have output biases
    the format does not describe, so it is refused here rather than saved in a layout that cannot be reloaded.
    Save the unprocessed model and pass `fold_ln=…` to `from_pretrained` when loading it. The DDiT research models
    (MDLM, Duo, BD3LM, GIDD) are refused too: the format has no adaLN / σ conditioning, so the folder would not load."""
    unsaved = getattr(type(model), "native_format_refusal", "")
    if unsaved:  # a model class whose config the native format does not describe (the DDiT research models)
        raise ArgumentError(f"save_pretrained: a {type(model).__name__} ({model.cfg.family}) model cannot be written in "
                            f"mdm_lens' format: {unsaved}.", argument="model", value=type(model).__name__,
                            allowed="a HookedMDM model")
    done = [k for k, v in (getattr(model, "weight_processing", None) or {}).items() if v]
    if done:
        raise ArgumentError(f"save_pretrained: this model was processed ({', '.join(done)}); mdm_lens saves "
                            "unprocessed weights only (a processed model lacks the norm weights a reload builds). Save "
                            "the model before process_weights_(), and reload it with from_pretrained(..., "
                            f"{'=True, '.join(done)}=True).", argument="model", value=done,
                            allowed="a model without weight processing")
    require_resident(model, "save_pretrained")  # offloaded weights are on meta: nothing to write
    folder = validate.output_folder(folder, name="folder")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(model.cfg.to_json())
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if model.cfg.tie_word_embeddings:
        state.pop("unembed.weight")
    save_file(state, str(folder / "model.safetensors"))
    if model.tokenizer is not None and hasattr(model.tokenizer, "save"):
        model.tokenizer.save(str(folder / "tokenizer.json"))
    return folder
