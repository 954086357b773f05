"""Tiny models of every family for the loss and gradient tests: each family's config as its loader reads it from a
checkpoint in the released layout (tests/families/family_checkpoints.py, tests/tiny_checkpoints.py,
test_fastdllm_v2.write_fastdllm_v2), with weights redrawn to look trained (`init="realistic"`: norm weights
log-normal around 1, biases and router biases non-zero)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "families"))

from family_checkpoints import write_llada2, write_lladamoe, write_sdar  # noqa: E402
from tiny_checkpoints import hf_reference, write_dream, write_llada  # noqa: E402

from mdm_lens import HookedMDM  # noqa: E402

FAMILIES = ("llada", "dream", "llada2", "lladamoe", "sdar", "sdar_moe", "fastdllm_v2")


def _checkpoint(name: str, folder: Path) -> Path:
    if name == "llada":
        return write_llada(hf_reference("llada", seed=1), folder, config_overrides={"include_qkv_bias": False})
    if name == "dream":
        return write_dream(hf_reference("dream", seed=2), folder)
    if name == "llada2":
        return write_llada2(folder)[0]
    if name == "lladamoe":
        return write_lladamoe(folder)[0]
    if name in ("sdar", "sdar_moe"):
        return write_sdar(folder, moe=name == "sdar_moe")[0]
    from test_fastdllm_v2 import write_fastdllm_v2

    return write_fastdllm_v2(folder)[0]


def family_model(name: str, folder: Path, seed: int = 0) -> HookedMDM:
    """The family's real config (mask id, logit shift, block length, MoE layout…), realistic random weights."""
    loaded = HookedMDM.from_pretrained(str(_checkpoint(name, folder)), load_tokenizer=False)
    return HookedMDM.from_config(loaded.cfg, seed=seed, init_std=0.08, init="realistic")


def family_getter(root: Path, seed: int):
    """`get(name)`: each family's model built once under `root` (a module-scoped fixture's memo)."""
    cache: dict[str, HookedMDM] = {}

    def get(name: str) -> HookedMDM:
        if name not in cache:
            cache[name] = family_model(name, root / name, seed=seed)
        return cache[name]
    return get
