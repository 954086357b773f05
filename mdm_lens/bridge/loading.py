"""Loading a transformers-native checkpoint into the bridge: transformers' own `from_pretrained`
(sharded safetensors, `dtype`, `device_map` placement across GPUs), offline from a local folder or
the HF cache, never remote code, and every missing/unexpected tensor named."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from mdm_lens.bridge.spec import FAMILY
from mdm_lens.errors import CheckpointError, CheckpointNotFoundError, ConfigError
from mdm_lens.loading.readers import CheckpointReader, refuse_non_floating
from mdm_lens.loading.resolve import load_tokenizer as read_tokenizer
from mdm_lens.loading.resolve import resolve

BRIDGED = ("DiffusionGemmaForBlockDiffusion",)  # dispatched here by `HookedMDM.from_pretrained`
MODEL_TYPES = {"diffusion_gemma": "DiffusionGemmaForBlockDiffusion"}


def bridged_architecture(folder: Path, only_dispatched: bool = True) -> str | None:
    """The transformers class a checkpoint folder's config.json names, if the bridge serves it."""
    path = Path(folder) / "config.json"
    if not path.exists():
        return None
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None  # the native loader reports the broken file
    if not isinstance(raw, dict):
        return None  # a list or a number: the native loader's ConfigError names the file and what it holds
    names = list(raw.get("architectures") or [])
    if raw.get("model_type") in MODEL_TYPES:
        names.append(MODEL_TYPES[raw["model_type"]])
    allowed = BRIDGED if only_dispatched else tuple(FAMILY)
    return next((n for n in names if n in allowed), None)


def load_hf(folder: Path, architecture: str, *, dtype: torch.dtype | str = torch.float32,
            device: str | torch.device = "cpu", device_map: Any = None) -> torch.nn.Module:
    import transformers

    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    cls = getattr(transformers, architecture)
    kwargs: dict[str, Any] = dict(dtype=dtype, local_files_only=True, trust_remote_code=False,
                                  output_loading_info=True)
    if device_map is not None:
        kwargs["device_map"] = device_map
    try:  # transformers would cast an integer weight silently: refused from the headers, as the native loaders do
        reader = CheckpointReader(Path(folder))
    except CheckpointNotFoundError:
        pass  # no weight files: transformers' own error names what it looked for
    else:
        refuse_non_floating(reader, reader.keys())
    try:
        model, info = cls.from_pretrained(str(folder), **kwargs)
    except (RuntimeError, ValueError, OSError) as e:
        raise CheckpointError(f"transformers could not load {architecture} from {folder}: {e}") from e
    problems = {k: sorted(v) for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if problems:
        detail = "; ".join(f"{len(v)} {k.replace('_', ' ')} {v[:6]}{' …' if len(v) > 6 else ''}"
                           for k, v in problems.items())
        raise CheckpointError(f"checkpoint at {folder} does not match its config.json: {detail}.")
    if device_map is None:
        model = model.to(device)
    return model.eval()


def load_bridge(cls: type, name_or_path: str, *, dtype: torch.dtype | str = torch.float32,
                device: str | torch.device = "cpu", device_map: Any = None, allow_download: bool = False,
                load_tokenizer: bool = True) -> Any:
    folder, _ = resolve(name_or_path, allow_download=allow_download)
    architecture = bridged_architecture(folder, only_dispatched=False)
    if architecture is None:
        raise ConfigError(f"{folder}/config.json names no architecture the bridge serves ({', '.join(FAMILY)}).")
    model = load_hf(folder, architecture, dtype=dtype, device=device, device_map=device_map)
    bridge = cls(model, tokenizer=read_tokenizer(folder) if load_tokenizer else None)
    if load_tokenizer:
        from mdm_lens.chat import read_chat_template

        bridge.chat_template = read_chat_template(folder)
    return bridge
