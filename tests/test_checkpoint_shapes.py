"""A checkpoint with any single tensor of the wrong shape, a missing tensor or an unexpected extra one is
refused with a CheckpointError naming that tensor, for every tensor of a tiny checkpoint of each family."""

from __future__ import annotations

import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from mdm_lens import CheckpointError, HookedMDM
from tiny_checkpoints import hf_reference, write_dream, write_hf, write_llada

WRITERS = {"llada": write_llada, "dream": write_dream, "llama": write_hf, "qwen2": write_hf}


@pytest.fixture(scope="module", params=sorted(WRITERS))
def checkpoint(request, tmp_path_factory):
    family = request.param
    folder = WRITERS[family](hf_reference(family), tmp_path_factory.mktemp(family))
    HookedMDM.from_pretrained(str(folder))  # the unperturbed checkpoint loads
    path = folder / "model.safetensors"
    return family, folder, path, load_file(str(path))


def _perturbed(shape: tuple[int, ...], dim: int) -> tuple[int, ...]:
    return tuple(n + 1 if i == dim else n for i, n in enumerate(shape))


def _refused(folder, path, tensors) -> str:
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError) as info:
        HookedMDM.from_pretrained(str(folder), load_tokenizer=False)
    return str(info.value)


def test_every_tensor_with_a_wrong_shape_is_refused_by_name(checkpoint):
    family, folder, path, original = checkpoint
    biased = [k for k in original if k.endswith("q_proj.bias")]
    assert (family in ("dream", "qwen2")) == bool(biased)  # the q/k/v biases are among the tensors checked
    checked = 0
    try:
        for key, tensor in sorted(original.items()):
            for dim in range(tensor.ndim):  # every axis: a wrong row count and a wrong column count
                bad = _perturbed(tuple(tensor.shape), dim)
                message = _refused(folder, path, {**original, key: torch.zeros(bad, dtype=tensor.dtype)})
                assert re.search(rf"{re.escape(key)} has shape {re.escape(str(bad))}, expected "
                                 rf"{re.escape(str(tuple(tensor.shape)))}", message), message
                assert message.count(" has shape ") == 1  # that tensor alone, not its fused neighbours
                checked += 1
    finally:
        save_file(original, str(path))
    assert checked == sum(t.ndim for t in original.values()) > len(original)


def test_a_missing_tensor_is_refused_by_name(checkpoint):
    family, folder, path, original = checkpoint
    try:
        for key in sorted(original):
            message = _refused(folder, path, {k: v for k, v in original.items() if k != key})
            assert "1 missing tensor(s)" in message and repr(key) in message and "0 unexpected" in message, message
    finally:
        save_file(original, str(path))


def test_an_unexpected_extra_tensor_is_refused_by_name(checkpoint):
    family, folder, path, original = checkpoint
    extra = "model.layers.0.self_attn.o_proj.bias" if family != "llada" else "model.transformer.blocks.0.attn_out.bias"
    try:
        message = _refused(folder, path, {**original, extra: torch.zeros(64)})
        assert "0 missing tensor(s)" in message and f"1 unexpected tensor(s) [{extra!r}]" in message, message
    finally:
        save_file(original, str(path))
