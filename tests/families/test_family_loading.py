"""Loader edges of the new families: save/load round trip, typed errors for missing tensors, bad block
lengths, odd rotary widths and TL's dense-MLP views on MoE layers."""

from __future__ import annotations

import pytest
import torch
from family_checkpoints import write_llada2, write_lladamoe, write_sdar
from safetensors.torch import load_file, save_file

from mdm_lens import HookedMDM
from mdm_lens.errors import ArgumentError, CheckpointError, ConfigError
from mdm_lens.loading import save_pretrained


def test_save_pretrained_round_trip(tmp_path):
    model = HookedMDM.from_pretrained(write_llada2(tmp_path / "llada2")[0])
    again = HookedMDM.from_pretrained(save_pretrained(model, tmp_path / "native"))
    assert again.cfg.extra == model.cfg.extra and again.cfg.family == "llada2_moe"
    tokens = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(again(tokens), model(tokens))


def test_missing_expert_tensor_is_named(tmp_path):
    folder, _, sd = write_lladamoe(tmp_path / "m")
    state = load_file(str(folder / "model.safetensors"))
    state.pop("model.layers.2.mlp.experts.5.up_proj.weight")
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"experts\.5\.up_proj"):
        HookedMDM.from_pretrained(folder)


def test_bad_block_length_and_rotary_width(tmp_path):
    model = HookedMDM.from_pretrained(write_sdar(tmp_path / "sdar")[0])
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ArgumentError, match="block_length"):  # InputError, or ArgumentTypeError for a non-int
            model(torch.zeros(1, 4, dtype=torch.long), block_length=bad)
    with pytest.raises(ConfigError, match="rotary_dim=5"):  # int(16 · 0.3125): an odd width has no halves
        HookedMDM.from_pretrained(write_llada2(tmp_path / "odd", partial_rotary_factor=0.3125)[0])


def test_moe_layers_have_no_dense_views(tmp_path):
    model = HookedMDM.from_pretrained(write_sdar(tmp_path / "moe", moe=True)[0])
    with pytest.raises(ConfigError, match=r"experts\[e\]\.W_in"):
        model.W_in
    assert model.blocks[1].mlp.experts[0].W_in.shape == (64, 24)
    assert model.blocks[0].mlp.W_in.shape == (64, 96)  # the dense layer keeps them
