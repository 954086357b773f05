"""The device-map checks of test_device_map_families on the families added in round four (RND1, CoDA,
Nemotron-Labs-Diffusion), each from its tiny hub layout: resident vs blocks on 'cpu' and 'disk' give the same
logits, cached activations, sampled tokens with step hooks, reducers, trajectory cache and absorption table.
The test bodies are those of test_device_map_families (imported, so pytest runs them here with this module's
`pair` fixture); only the checkpoints and each family's sampler settings differ. The DDiT research models
(MDLM, BD3LM, Duo, GIDD) have their own file: tests/test_device_map_ddit.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "families"))

import test_device_map_families as base  # noqa: E402
from test_device_map import mixed_map  # noqa: E402
from test_device_map_families import (test_absorption_table_matches,  # noqa: E402,F401
                                      test_logits_and_every_cached_activation_match, test_step_hook_changes_the_run,
                                      test_sampler_tokens_reducers_and_cache_match)

from mdm_lens import HookedMDM  # noqa: E402

base.GEN.update(rnd1=dict(sampler="rnd1", steps=8, gen_length=8), coda=dict(sampler="coda", steps=8, gen_length=8),
                nemotron=dict(sampler="nemotron", gen_length=8))


def _write(family: str, folder: Path) -> Path:
    if family == "nemotron":
        from nemotron_fixture import write_nemotron

        return write_nemotron(folder)[0]
    from rnd1_coda_checkpoints import write_coda, write_rnd1

    return (write_rnd1 if family == "rnd1" else write_coda)(folder)[0]


@pytest.fixture(scope="module", params=["rnd1", "coda", "nemotron"])
def pair(request, tmp_path_factory):
    dev = request.getfixturevalue("test_device")
    root = tmp_path_factory.mktemp(request.param)
    folder = str(_write(request.param, root / "ckpt"))
    ref = HookedMDM.from_pretrained(folder, load_tokenizer=False, device=dev)
    off = HookedMDM.from_pretrained(folder, load_tokenizer=False, device_map=mixed_map(ref.cfg.n_layers, dev),
                                    offload_folder=root / "offload")
    assert "disk" in off.hf_device_map.values() and "cpu" in off.hf_device_map.values()
    return request.param, ref, off, dev

