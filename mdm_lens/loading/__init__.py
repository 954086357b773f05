"""`from_pretrained`: resolve a name or path, read `config.json`, convert the weights, check them.

Resolution order: a shipped zoo model → a local folder → a Hugging Face hub id found in the local HF
cache (downloads only when `allow_download=True` and offline mode is off). Nothing from a checkpoint is
ever executed: `auto_map`/remote code is ignored, tensors come from safetensors or
`torch.load(weights_only=True)`.
"""

from __future__ import annotations

import difflib
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from mdm_lens.config import MDMConfig
from mdm_lens.errors import CheckpointError, CheckpointNotFoundError, ConfigError, UnknownModelError
from mdm_lens.loading.hf import config_from_hf, hf_family, hf_plan
from mdm_lens.loading.llada import config_from_llada, is_llada, llada_plan
from mdm_lens.loading.plan import Plan
from mdm_lens.loading.readers import CheckpointReader
from mdm_lens.loading.registry import FAMILY_DEFAULTS, KNOWN_MODELS, KnownModel, lookup

ZOO_DIR = Path(__file__).resolve().parent.parent / "zoo" / "assets"
_ALLOW = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]


def resolve(name_or_path: str | os.PathLike, allow_download: bool = False) -> tuple[Path, KnownModel | None]:
    """The local folder holding the checkpoint, and its registry entry if it is a known model."""
    text = str(name_or_path)
    known = lookup(text)
    if known is not None and known.zoo:
        folder = ZOO_DIR / known.name.split("/")[-1]
        if not (folder / "config.json").exists():
            raise CheckpointNotFoundError(f"the zoo model {known.name} is not in this installation ({folder}). "
                                          "Rebuild it with `python -m mdm_lens.zoo.train`.")
        return folder, known
    path = Path(text).expanduser()
    if path.is_dir():
        return path, known
    if text.startswith((".", "/", "~")) or os.sep in text.strip("/").replace("/", "", 1):
        raise CheckpointNotFoundError(f"no folder at {path}. Pass an existing checkpoint folder or a hub id.")
    if "/" not in text:
        close = difflib.get_close_matches(text, list(KNOWN_MODELS), n=3, cutoff=0.3)
        raise UnknownModelError(f"unknown model {text!r}: not a folder and not a hub id (org/name). Known models: "
                                f"{', '.join(KNOWN_MODELS)}." + (f" Did you mean {close[0]}?" if close else ""))
    return _from_hf_cache(text, allow_download), known


def _from_hf_cache(repo_id: str, allow_download: bool) -> Path:
    from huggingface_hub import snapshot_download

    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
    # read the cache location now, not at huggingface_hub's import, so a changed HF_HUB_CACHE is honoured
    cache_dir = os.environ.get("HF_HUB_CACHE") or (
        os.path.join(os.environ["HF_HOME"], "hub") if os.environ.get("HF_HOME") else None)
    try:
        return Path(snapshot_download(repo_id, local_files_only=True, allow_patterns=_ALLOW, cache_dir=cache_dir))
    except Exception as cached_error:  # LocalEntryNotFoundError and friends
        if allow_download and not offline:
            return Path(snapshot_download(repo_id, allow_patterns=_ALLOW, cache_dir=cache_dir))
        why = "HF_HUB_OFFLINE is set" if offline else "downloads are off by default (allow_download=False)"
        raise CheckpointNotFoundError(
            f"{repo_id} is not in the Hugging Face cache ({type(cached_error).__name__}) and {why}. Fetch it once "
            f"with `hf download {repo_id} --include '*.json' '*.safetensors' 'tokenizer*'` (or "
            "`huggingface-cli download …`), or pass the local folder that holds config.json and the weights."
        ) from cached_error


def read_config(folder: Path, name: str, known: KnownModel | None) -> tuple[MDMConfig, str]:
    path = folder / "config.json"
    if not path.exists():
        raise CheckpointNotFoundError(f"{folder} has no config.json; it is not a checkpoint folder.")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}.") from e
    if raw.get("model_type") == "mdm_lens":
        cfg = MDMConfig.from_dict({k: v for k, v in raw.items() if k != "model_type"})
        return cfg, "mdm_lens"
    if is_llada(raw):
        cfg, family = config_from_llada(raw, name), "llada"
    else:
        family = hf_family(raw)
        if family is None:
            raise ConfigError(f"{path}: architectures={raw.get('architectures')} model_type={raw.get('model_type')!r} "
                              "is not a supported family (LLaDAModelLM, DreamModel, LlamaForCausalLM, "
                              "Qwen2ForCausalLM).")
        cfg = config_from_hf(raw, family, name)
    _apply_special_tokens(cfg, known, family)
    return cfg, family


def _apply_special_tokens(cfg: MDMConfig, known: KnownModel | None, family: str) -> None:
    facts = dict(FAMILY_DEFAULTS.get(family, {}))
    if known is not None:
        facts.update(mask_token_id=known.mask_token_id, bos_token_id=known.bos_token_id,
                     eos_token_id=known.eos_token_id, pad_token_id=known.pad_token_id)
        cfg.extra["special_tokens"] = dict(known.special)
    for key, value in facts.items():
        if getattr(cfg, key) is None and value is not None:
            setattr(cfg, key, value)
    cfg.extra.setdefault("prepend_bos", family == "llama")


def native_plan(cfg: MDMConfig, keys: list[str]) -> Plan:
    from mdm_lens.model import HookedMDM

    with torch.device("meta"):
        names = list(HookedMDM(cfg).state_dict())
    if cfg.tie_word_embeddings:
        names.remove("unembed.weight")
    return {n: [n] for n in names}


def build_state_dict(plan: Plan, reader: CheckpointReader, expected: dict[str, tuple[int, ...]],
                     dtype: torch.dtype, device: str | torch.device) -> dict[str, torch.Tensor]:
    """Check every source tensor is present with the right shape, then assemble (cat) and cast."""
    keys = set(reader.keys())
    wanted = {src for sources in plan.values() for src in sources}
    missing = sorted(wanted - keys)
    extra = sorted(k for k in keys - wanted if not k.endswith("inv_freq"))
    if missing or extra:
        raise CheckpointError(
            f"checkpoint at {reader.folder} does not match its config: {len(missing)} missing tensor(s) "
            f"{missing[:8]}{' …' if len(missing) > 8 else ''}; {len(extra)} unexpected tensor(s) "
            f"{extra[:8]}{' …' if len(extra) > 8 else ''}. Check that config.json belongs to these weights."
        )
    out = {}
    for target, sources in plan.items():
        parts = [reader.get(src) for src in sources]
        tensor = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        if tuple(tensor.shape) != expected[target]:
            raise CheckpointError(
                f"shape mismatch for {target}: the checkpoint gives {tuple(tensor.shape)} (from "
                f"{ {s: tuple(p.shape) for s, p in zip(sources, parts)} }), the config "
                f"implies {expected[target]}. config.json and the weights disagree (d_model, heads, kv heads, d_mlp "
                "or vocab size)."
            )
        out[target] = tensor.to(device=device, dtype=dtype)
    return out


def load_pretrained(cls: type, name_or_path: str | os.PathLike, *, dtype: torch.dtype | str = torch.float32,
                    device: str | torch.device = "cpu", allow_download: bool = False,
                    load_tokenizer: bool = True, device_map: Any = None) -> Any:
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    folder, known = resolve(name_or_path, allow_download=allow_download)
    from mdm_lens.bridge.loading import bridged_architecture, load_bridge

    if bridged_architecture(folder):  # transformers-native families (DiffusionGemma) load into the bridge
        from mdm_lens.bridge import TransformersBridge

        return load_bridge(TransformersBridge, str(folder), dtype=dtype, device=device, device_map=device_map,
                           load_tokenizer=load_tokenizer)
    if device_map is not None:
        raise ConfigError("device_map applies to transformers-native checkpoints (the bridge); "
                          f"{folder} loads into HookedMDM: pass device= instead.")
    name = known.name if known else str(name_or_path)
    cfg, family = read_config(folder, name, known)
    cfg.dtype, cfg.device = dtype, device
    reader = CheckpointReader(folder)
    keys = reader.keys()
    plan = {"llada": llada_plan, "mdm_lens": native_plan}.get(family, hf_plan)(cfg, keys)
    with torch.device("meta"):
        model = cls(cfg)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    state = build_state_dict(plan, reader, expected, dtype, device)
    if cfg.tie_word_embeddings:
        state["unembed.weight"] = state["embed.W_E"]
    model.load_state_dict(state, strict=True, assign=True)
    if cfg.tie_word_embeddings:
        model.unembed.weight = model.embed.W_E
    if load_tokenizer:
        model.tokenizer = _load_tokenizer(folder)
    return model.eval()


def _load_tokenizer(folder: Path) -> Any:
    """A tokenizer from the folder's files, without remote code; None when the folder has none."""
    if (folder / "tokenizer.json").exists():
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(folder / "tokenizer.json"))
    return None


def save_pretrained(model: Any, folder: str | os.PathLike) -> Path:
    """Write a model in mdm_lens' own format: config.json (`model_type: mdm_lens`) + model.safetensors."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(model.cfg.to_json())
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if model.cfg.tie_word_embeddings:
        state.pop("unembed.weight")
    save_file(state, str(folder / "model.safetensors"))
    if model.tokenizer is not None and hasattr(model.tokenizer, "save"):
        model.tokenizer.save(str(folder / "tokenizer.json"))
    return folder
