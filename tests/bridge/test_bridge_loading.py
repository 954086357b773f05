"""Loading DiffusionGemma checkpoints: `HookedMDM.from_pretrained` dispatches by config.json to the
bridge; sharded safetensors, bf16, device_map, the offline HF cache, named missing tensors; the
released checkpoint's text config builds the right bridge (on the meta device: no weights)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mdm_lens import HookedMDM
from mdm_lens.bridge import TransformersBridge
from mdm_lens.bridge.tiny import tiny_diffusion_gemma
from mdm_lens.errors import CheckpointError, ConfigError

FIXTURE = Path(__file__).parent / "fixtures" / "diffusiongemma_26b_a4b_text_config.json"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    ref = tiny_diffusion_gemma(seed=2)
    folder = tmp_path_factory.mktemp("dg") / "tiny-dg"
    ref.save_pretrained(str(folder), max_shard_size="200KB")
    return ref, folder


def _io():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 128, (1, 6), generator=g), torch.randint(0, 128, (1, 8), generator=g)


def test_sharded_checkpoint_dispatches_to_the_bridge(saved):
    ref, folder = saved
    assert (folder / "model.safetensors.index.json").exists()
    model = HookedMDM.from_pretrained(str(folder))
    assert isinstance(model, TransformersBridge) and model.cfg.family == "diffusion_gemma"
    ids, canvas = _io()
    with torch.no_grad():
        assert (model(ids, decoder_input_ids=canvas) - ref(input_ids=ids, decoder_input_ids=canvas).logits).abs().max() <= 1e-4


def test_bf16_and_device_map(saved, monkeypatch):
    from transformers import DiffusionGemmaForBlockDiffusion

    ref, folder = saved
    seen, original = {}, DiffusionGemmaForBlockDiffusion.from_pretrained
    monkeypatch.setattr(DiffusionGemmaForBlockDiffusion, "from_pretrained",
                        lambda *a, **k: (seen.update(k), original(*a, **k))[1])
    model = HookedMDM.from_pretrained(str(folder), dtype=torch.bfloat16, device_map={"": "cpu"})
    assert model.W_E.dtype == torch.bfloat16
    assert seen["device_map"] == {"": "cpu"} and seen["local_files_only"] and not seen["trust_remote_code"]
    ids, canvas = _io()
    with torch.no_grad():
        low = model(ids, decoder_input_ids=canvas)
        full = ref(input_ids=ids, decoder_input_ids=canvas).logits
    assert low.dtype == torch.float32  # transformers upcasts before the softcap
    assert torch.corrcoef(torch.stack([low.flatten(), full.flatten()]))[0, 1] > 0.99


def test_offline_hf_cache(saved, tmp_path, monkeypatch):
    _, folder = saved
    repo = tmp_path / "hub" / "models--google--diffusiongemma-26B-A4B-it"
    shutil.copytree(folder, repo / "snapshots" / ("b" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("b" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = TransformersBridge.from_pretrained("google/diffusiongemma-26B-A4B-it")
    assert model.cfg.extra["canvas_length"] == 8


def test_missing_tensor_is_named(saved, tmp_path):
    ref, _ = saved
    folder = tmp_path / "broken"
    ref.save_pretrained(str(folder))
    weights = load_file(str(folder / "model.safetensors"))
    key = next(k for k in weights if "self_conditioning.gate_proj" in k)
    del weights[key]
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="self_conditioning.gate_proj"):
        HookedMDM.from_pretrained(str(folder))


def test_device_map_on_a_native_family_places_it_and_a_bad_map_is_refused(tmp_path):
    """HookedMDM families take device_map since issue #28 (accelerate's placement): a map naming every module of a
    Llama twin loads with the same logits; a map naming a module the model lacks is refused naming device_map."""
    import sys

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tiny_checkpoints import hf_reference, write_hf

    folder = write_hf(hf_reference("llama"), tmp_path / "llama")
    ref = HookedMDM.from_pretrained(str(folder))
    placed = HookedMDM.from_pretrained(str(folder), device_map={"": "cpu"})
    tokens = torch.tensor([[1, 5, 9, 12]])
    assert placed.hf_device_map == {"": "cpu"} and torch.equal(ref(tokens), placed(tokens))
    from mdm_lens.errors import ArgumentError

    with pytest.raises(ArgumentError, match="device_map names modules this model does not have") as info:
        HookedMDM.from_pretrained(str(folder), device_map={"no_such_module": "cpu"})
    assert info.value.argument == "device_map"


def test_released_text_config_builds_the_right_bridge():
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    raw = json.loads(FIXTURE.read_text())
    cfg = DiffusionGemmaConfig(text_config=raw["text_config"], canvas_length=raw["canvas_length"],
                               vision_config=dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=16,
                                                  num_hidden_layers=1, num_attention_heads=2,
                                                  num_key_value_heads=2, head_dim=8))
    with torch.device("meta"):
        hf = DiffusionGemmaForBlockDiffusion(cfg)
    bridge = TransformersBridge(hf)
    c = bridge.cfg
    assert (c.n_layers, c.d_model, c.n_heads, c.d_vocab) == (30, 2816, 16, 262144)
    assert c.extra["head_dims"] == [256] * 5 + [512] + [256] * 5 + [512] + [256] * 5 + [512] + [256] * 5 + [512] + [256] * 5 + [512]
    assert c.extra["kv_heads"] == ([8] * 5 + [2]) * 5
    assert c.extra["sliding_window"] == 1024 and c.extra["canvas_length"] == 256
    assert c.extra["eos_token_ids"] == [1, 106, 50] and c.eos_token_id == 1 and c.pad_token_id == 0
    names = set(bridge.hook_dict)
    assert {"blocks.29.attn.hook_pattern", "encoder.29.attn.hook_pattern", "blocks.5.mlp.hook_router_logits"} <= names
    full_rope = hf.model.decoder.rotary_emb.full_attention_inv_freq  # proportional RoPE on full layers
    assert full_rope.shape == (256,)


def test_accelerate_placement_hooks_are_kept():
    """device_map / offloading put accelerate's AlignDevicesHook on the layers (`_hf_hook`, `_old_forward`): it moves
    inputs to the layer's device and loads offloaded weights. The bridge must run inside those hooks, hooked or not.
    `cpu_offload` is the CPU-testable case (every weight on the meta device until its module runs); a multi-GPU
    `device_map` uses the same hooks with a device per layer."""
    import copy

    from accelerate import cpu_offload

    ref = tiny_diffusion_gemma(seed=2)
    plain = TransformersBridge(copy.deepcopy(ref))
    placed = copy.deepcopy(ref)
    cpu_offload(placed, execution_device=torch.device("cpu"), offload_buffers=True)
    layer = placed.model.decoder.layers[1]
    assert layer.layer_scalar.device.type == "meta" and hasattr(layer, "_hf_hook")
    accelerate_forward = layer._old_forward
    bridge = TransformersBridge(placed)
    assert bridge.input_device == torch.device("cpu") and bridge.W_E.device.type == "meta"
    ids, canvas = _io()
    with torch.no_grad():
        want = ref(input_ids=ids, decoder_input_ids=canvas).logits
        assert torch.equal(bridge(ids, decoder_input_ids=canvas), want)           # unhooked: transformers' code
        got, cache = bridge.run_with_cache(ids, decoder_input_ids=canvas)          # every hook: the wrappers
        _, cache_plain = plain.run_with_cache(ids, decoder_input_ids=canvas)
    assert (got - want).abs().max().item() <= 1e-4
    for name in ("blocks.1.attn.hook_pattern", "blocks.1.hook_resid_post", "encoder.0.hook_mlp_out"):
        assert torch.equal(cache[name], cache_plain[name])
    # (generation is not compared: under cpu_offload transformers' own generate already departs from the resident
    # model's tokens, so offloading, not the bridge, would decide such a test)
    hf = bridge.unbridge()
    assert layer._old_forward is accelerate_forward and "forward" in layer.__dict__  # accelerate's own, restored
    with torch.no_grad():
        assert torch.equal(hf(input_ids=ids, decoder_input_ids=canvas).logits, want)
