"""Device maps, offloading and planning (`mdm_lens.loading.placement`), device-agnostic.

The accelerator is `--device` / $MDM_LENS_TEST_DEVICE (default cpu): the mixed map puts the embedding and the first
block there, one block on 'cpu' (offloaded to host memory when the accelerator is a GPU), one on 'disk'
(accelerate's offload under tmp_path). On CPU the computation is the same arithmetic on the same device, so the
results must be bit-identical; on a GPU the reference is the same model resident on that GPU (same kernels)."""

from __future__ import annotations

import pytest
import torch
from accelerate import init_empty_weights

from mdm_lens import HookedMDM, MDMConfig  # noqa: F401
from mdm_lens.errors import ArgumentError, ArgumentTypeError
from mdm_lens.loading import placement


def mixed_map(n_layers: int, dev: str) -> dict:
    """embed + block 0 on the accelerator, then 'disk', 'cpu' alternating; the final norm on 'disk'."""
    out = {"embed": dev, "blocks.0": dev}
    for layer in range(1, n_layers):
        out[f"blocks.{layer}"] = "disk" if layer % 2 else "cpu"
    out.update(ln_final="disk", unembed="cpu" if dev == "cpu" else dev)
    return out


def same(a: torch.Tensor, b: torch.Tensor, dev: str) -> bool:
    """Equal to 1e-6 of the tensor's scale on CPU (weights read back from accelerate's disk offload are memory-mapped
    arrays: a different alignment can change a kernel's summation order in the last bit, seen at 1.5e-8 in
    LLaDA-MoE's expert outputs), 1e-5 on a GPU (the same kernels, fp32)."""
    a, b = a.cpu().double(), b.cpu().double()
    finite = torch.isfinite(a)
    if not torch.equal(finite, torch.isfinite(b)) or not torch.equal(a[~finite].nan_to_num(), b[~finite].nan_to_num()):
        return False  # masked scores (-inf), NaN reducer entries: the same places, the same values
    if not bool(finite.any()):
        return True
    scale = a[finite].abs().max().clamp_min(1e-12)
    return bool(((a[finite] - b[finite]).abs().max() / scale) <= (1e-6 if dev == "cpu" else 1e-5))


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory, request):
    dev = request.getfixturevalue("test_device")
    ref = HookedMDM.from_pretrained("mdm-lens/tiny-mdm", device=dev)
    dm = mixed_map(ref.cfg.n_layers, dev)
    off = HookedMDM.from_pretrained("mdm-lens/tiny-mdm", device_map=dm,
                                    offload_folder=tmp_path_factory.mktemp("offload"))
    return ref, off, dm, dev


def test_map_is_recorded_and_disk_blocks_sit_on_meta(tiny_pair):
    ref, off, dm, dev = tiny_pair
    assert off.hf_device_map == dm
    assert ref.hf_device_map == {"": str(torch.device(dev))}
    assert off.input_device == torch.device(dev) and off.cfg.device == torch.device(dev)
    disk = [k for k, v in dm.items() if v == "disk"]
    assert disk and all(p.device.type == "meta" for k in disk for p in off.get_submodule(k).parameters())
    assert off.embed.W_E.device == torch.device(dev)


def test_offloaded_logits_and_cache_equal_resident(tiny_pair):
    ref, off, _, dev = tiny_pair
    tokens = torch.randint(0, ref.cfg.d_vocab - 1, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert same(ref(tokens), off(tokens), dev)
        _, ca = ref.run_with_cache(tokens)
        _, cb = off.run_with_cache(tokens)
    assert sorted(ca.keys()) == sorted(cb.keys()) and len(ca.keys()) > 40
    assert all(same(ca[k], cb[k], dev) for k in ca.keys())


def test_hooks_fire_where_the_block_runs_and_edits_take_effect(tiny_pair):
    ref, off, dm, dev = tiny_pair
    tokens = torch.arange(3, 13)[None]
    seen = {}

    def zero_head(z, hook):
        seen[hook.name] = z.device
        z[:, :, 0] = 0.0
        return z

    name = "blocks.1.attn.hook_z"  # a disk-offloaded block: its weights are loaded onto the execution device
    with torch.no_grad():
        a = ref.run_with_hooks(tokens, fwd_hooks=[(name, zero_head)])
        b = off.run_with_hooks(tokens, fwd_hooks=[(name, zero_head)])
        clean = off(tokens)
    assert seen[name] == torch.device(dev) and same(a, b, dev) and not torch.equal(b, clean)
    assert all(not hp.fwd_hooks for hp in off.hook_dict.values())  # removed afterwards


def test_sampled_tokens_equal_with_the_same_seed(tiny_pair):
    ref, off, _, dev = tiny_pair
    prompt = torch.tensor([[5, 9, 14, 30, 8, 21]])
    kw = dict(steps=4, gen_length=8, block_length=4, temperature=0.7, seed=3)
    ga, gb = ref.generate(prompt, **kw), off.generate(prompt, **kw)
    assert torch.equal(ga.tokens.cpu(), gb.tokens.cpu())
    for cache in ("prefix", "dual"):  # Fast-dLLM KV caches: per-layer keys and values live on the layer's device
        ga, gb = ref.generate(prompt, kv_cache=cache, **kw), off.generate(prompt, kv_cache=cache, **kw)
        assert torch.equal(ga.tokens.cpu(), gb.tokens.cpu())


def test_plan_keeps_blocks_whole_within_budgets():
    """An 8-layer LLaDA2-layout MoE over three fake devices: every block on one device, no budget exceeded."""
    cfg = _moe_cfg()
    with init_empty_weights():
        meta = HookedMDM(cfg)
    sizes = {n: sum(p.numel() * 4 for p in m.parameters()) for n, m in meta.named_children()}
    block = max(sum(p.numel() * 4 for p in b.parameters()) for b in meta.blocks)
    budgets = {0: 3 * block + sizes["embed"], 1: 3 * block, 2: 3 * block + sizes["unembed"] + 4096, "cpu": 10**9}
    dm = placement.plan(meta, "sequential", budgets, torch.float32)
    assert set(dm) >= {f"blocks.{i}" for i in range(8)}  # whole blocks, never blocks.3.attn
    assert not any(k.count(".") > 1 for k in dm)
    used: dict = {}
    for name, dev in dm.items():
        used[dev] = used.get(dev, 0) + sum(p.numel() * 4 for p in meta.get_submodule(name).parameters())
    assert all(used[d] <= budgets[d] for d in used)
    assert {dm[f"blocks.{i}"] for i in range(8)} >= {0, 1, 2}  # it had to spread
    balanced = placement.plan(meta, "balanced", {0: 10**9, 1: 10**9, "cpu": 10**9}, torch.float32)
    per = [sum(1 for i in range(8) if balanced[f"blocks.{i}"] == d) for d in (0, 1)]
    assert min(per) >= 3  # balanced: neither device holds (almost) everything


def _moe_cfg() -> MDMConfig:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "families"))
    from family_checkpoints import LLADA2_CONFIG
    from mdm_lens.loading import family_config

    raw = {**LLADA2_CONFIG, "num_hidden_layers": 8}
    return family_config(raw, "llada2_moe", "moe8", Path("."))


def test_bad_arguments_are_refused_by_name(tmp_path):
    with pytest.raises(ArgumentError, match="offload_folder"):
        HookedMDM.from_pretrained("mdm-lens/tiny-mdm", device_map={"": "disk"})
    with pytest.raises(ArgumentError, match="n_devices=4.*CUDA device"):
        if torch.cuda.device_count() >= 4:
            pytest.skip("this machine has 4 GPUs")
        HookedMDM.from_pretrained("mdm-lens/tiny-mdm", n_devices=4)
    with pytest.raises(ArgumentError, match="without a device"):
        HookedMDM.from_pretrained("mdm-lens/tiny-mdm", device_map={"embed": "cpu"})
    with pytest.raises(ArgumentError, match="does not have.*blocks.9"):
        HookedMDM.from_pretrained("mdm-lens/tiny-mdm", device_map={"": "cpu", "blocks.9": "cpu"})
    with pytest.raises(ArgumentError, match="device_map"):
        HookedMDM.from_pretrained("mdm-lens/tiny-mdm", device_map="everywhere")
    with pytest.raises(ArgumentTypeError, match="max_memory"):
        HookedMDM.from_pretrained("mdm-lens/tiny-mdm", device_map="auto", max_memory=[1, 2])
    with pytest.raises(ArgumentError, match="max_memory= only applies"):
        HookedMDM.from_pretrained("mdm-lens/tiny-mdm", max_memory={"cpu": 10**9})


def test_auto_map_under_a_cpu_budget_offloads_the_rest_to_disk(tmp_path):
    """accelerate's planner with max_memory={'cpu': …}: what does not fit goes to 'disk', and the logits stay."""
    ref = HookedMDM.from_pretrained("mdm-lens/tiny-mdm")
    weights = sum(p.numel() * 4 for p in ref.parameters())
    off = HookedMDM.from_pretrained("mdm-lens/tiny-mdm", device_map="auto", max_memory={"cpu": weights // 2},
                                    offload_folder=tmp_path)
    devices = set(off.hf_device_map.values())
    assert devices == {"cpu", "disk"}
    tokens = torch.arange(2, 20)[None]
    with torch.no_grad():
        assert torch.equal(ref(tokens), off(tokens))


def test_nested_map_entries_are_split_into_children(tmp_path):
    """{'': 'cpu', 'blocks.1': 'disk'}: block 1 on disk, everything else on the CPU (accelerate needs disjoint
    entries; the '' entry is replaced by the top-level modules)."""
    ref = HookedMDM.from_pretrained("mdm-lens/tiny-mdm")
    off = HookedMDM.from_pretrained("mdm-lens/tiny-mdm", device_map={"": "cpu", "blocks.1": "disk"},
                                    offload_folder=tmp_path)
    assert off.hf_device_map["blocks.1"] == "disk" and off.hf_device_map["blocks.0"] == "cpu"
    assert "" not in off.hf_device_map
    assert {p.device.type for p in off.blocks[1].parameters()} == {"meta"}
    assert {p.device.type for p in off.blocks[2].parameters()} == {"cpu"}
    tokens = torch.arange(2, 20)[None]
    with torch.no_grad():
        assert torch.equal(ref(tokens), off(tokens))


def test_tied_embeddings_offloaded_to_disk_keep_the_logits(tmp_path):
    """A tied unembedding is the embedding tensor: on 'disk' it is written under both names (each module's hook
    loads its own), and a map that splits the two is refused."""
    from mdm_lens.loading import save_pretrained

    cfg = MDMConfig(d_model=32, n_layers=2, n_heads=2, d_mlp=64, d_vocab=50, n_ctx=32, family="mdm_lens",
                    mask_token_id=49, tie_word_embeddings=True)
    ref = HookedMDM.from_config(cfg, seed=1, init_std=0.2)
    folder = save_pretrained(ref, tmp_path / "tied")
    off = HookedMDM.from_pretrained(str(folder), device_map={"": "cpu", "embed": "disk", "unembed": "disk"},
                                    offload_folder=tmp_path / "off")
    tokens = torch.arange(1, 12)[None]
    with torch.no_grad():
        assert torch.equal(ref(tokens), off(tokens))
    with pytest.raises(ArgumentError, match="tied"):
        HookedMDM.from_pretrained(str(folder), device_map={"": "cpu", "embed": "disk"}, offload_folder=tmp_path)
