"""The DDiT research models (MDLM, Duo, BD3LM, GIDD-DiT), each from its tiny hub layout with four blocks (config
values that differ from the class defaults; MDLM time-conditioned so its σ path is live), loaded with a device map
that sends half the blocks to 'disk' and the rest to 'cpu' — and the conditioning MLP and the output head to
'disk' as well — compute what the resident model computes: logits of every return type (BD3LM's training and
KV-cached forms too), `readout`, every cached activation (conditioning and adaLN hooks included), and the family's
samplers' tokens, reducers and trajectory cache, with and without a step hook on a disk block.

Tolerance. Single forwards: `test_device_map.same` (1e-6 of the tensor's scale on CPU, 1e-5 on an accelerator).
Sampler runs: identical tokens, and reducers / trajectory caches within TRAJECTORY_REL of their scale. Why not
bit-identical on CPU: the resident model keeps each weight in the safetensors buffer it was read into (here at 4 mod
64 bytes), the offloaded one gets accelerate's aligned copies, and a batch-1 matrix-vector product picks another
BLAS kernel by alignment — measured 3.6e-7 on the σ-embedding MLP (same values copied to an aligned buffer: 0 apart),
which a 6-step run carries to at most 1.3e-5 of the scale (Duo's residual). `--device cuda:0` puts the embedding
on the accelerator, which then runs the offloaded modules (accelerate streams them in)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "families"))

from test_device_map import same  # noqa: E402

from mdm_lens import HookedMDM, ReceivedAttention, TrajectoryCache, at_steps  # noqa: E402
from mdm_lens.ddit import HookedDDiT  # noqa: E402
from mdm_lens.errors import ArgumentError, ArgumentTypeError, MemoryBudgetError  # noqa: E402
from tests.families.bd3gidd_checkpoints import BD3LM_CONFIG, GIDD_CONFIG, write_bd3lm, write_gidd  # noqa: E402
from tests.families.ddit_checkpoints import DUO_CONFIG, MDLM_CONFIG, write_ddit  # noqa: E402

N_BLOCKS = 4
TRAJECTORY_REL = 1e-4  # see the module docstring: ~8x the largest difference measured over the four families
CACHED = ["blocks.1.hook_resid_post", "hook_cond", "blocks.3.adaLN.hook_gate_mlp"]  # blocks 1 and 3: 'disk'
# each family's samplers, in the settings that exercise their distinct paths (MDLM predictors; BD3LM's KV cache)
RUNS = {"mdlm": [dict(predictor="ddpm_cache"), dict(predictor="ddpm"), dict(predictor="analytic")],
        "duo": [dict(noise_removal="ancestral"), dict(noise_removal="greedy")],
        "bd3lm": [dict(kv_cache=False), dict(kv_cache=True)],
        "gidd": [dict()]}
RETURN_TYPES = {"gidd": ("logits", "aligned", "log_probs", "gidd", "log_softmax")}
SIGMA = {"gidd": 0.4}  # GIDD is conditioned on t ∈ [0, 1]; the others on σ ≥ 0


def write(family: str, folder: Path) -> Path:
    if family == "mdlm":
        return write_ddit(folder, dict(MDLM_CONFIG, n_blocks=N_BLOCKS, time_conditioning=True), seed=21)[0]
    if family == "duo":
        return write_ddit(folder, dict(DUO_CONFIG, n_blocks=N_BLOCKS), seed=22)[0]
    if family == "bd3lm":
        return write_bd3lm(folder, dict(BD3LM_CONFIG, n_blocks=N_BLOCKS), seed=23)[0]
    return write_gidd(folder, dict(GIDD_CONFIG, num_hidden_layers=N_BLOCKS), seed=24)[0]


def ddit_map(dev: str) -> dict:
    """The embedding on `dev`; blocks alternate 'cpu' / 'disk' (half each); the σ-embedding MLP, the final norm
    and the unembedding on 'disk', the final adaLN on 'cpu'."""
    out = {"embed": dev, "time_embed": "disk", "final_adaLN": "cpu", "ln_final": "disk", "unembed": "disk"}
    out.update({f"blocks.{i}": "disk" if i % 2 else "cpu" for i in range(N_BLOCKS)})
    return out


def near(a: torch.Tensor, b: torch.Tensor, rel: float) -> bool:
    """Equal non-finite entries (NaN pads of an aligned stack) and finite ones within `rel` of the scale."""
    a, b = a.cpu().double(), b.cpu().double()
    fa = torch.isfinite(a)
    if not torch.equal(fa, torch.isfinite(b)) or not torch.equal(a[~fa].nan_to_num(), b[~fa].nan_to_num()):
        return False
    return not bool(fa.any()) or bool((a[fa] - b[fa]).abs().max() <= rel * a[fa].abs().max().clamp_min(1e-12))


@pytest.fixture(scope="module", params=["mdlm", "duo", "bd3lm", "gidd"])
def pair(request, tmp_path_factory):
    dev = request.getfixturevalue("test_device")
    root = tmp_path_factory.mktemp(request.param)
    folder = str(write(request.param, root / "ckpt"))
    ref = HookedMDM.from_pretrained(folder, load_tokenizer=False, device=dev)
    off = HookedMDM.from_pretrained(folder, load_tokenizer=False, device_map=ddit_map(dev),
                                    offload_folder=root / "offload")
    return request.param, ref, off, dev


def _tokens(model, n: int = 12) -> torch.Tensor:
    g = torch.Generator().manual_seed(5)  # ids below every family's mask id (the last vocabulary entry)
    t = torch.randint(0, 40, (2, n), generator=g)
    if model.cfg.mask_token_id is not None:
        t[:, ::3] = model.cfg.mask_token_id  # SUBS treats masked and unmasked rows differently: both present
    return t


def test_the_map_is_applied_and_recorded(pair):
    family, ref, off, dev = pair
    assert off.hf_device_map == ddit_map(dev)
    assert ref.hf_device_map == {"": dev}
    assert off.input_device == torch.device(dev) and off.cfg.device == torch.device(dev)
    assert type(off) is type(ref) and isinstance(off, HookedDDiT)
    on_meta = {n.split(".")[0] if not n.startswith("blocks.") else ".".join(n.split(".")[:2])
               for n, p in off.named_parameters() if p.device.type == "meta"}
    assert on_meta == {"blocks.1", "blocks.3", "time_embed", "ln_final", "unembed"}  # disk modules only
    assert off.W_E.device == torch.device(dev) and torch.equal(off.W_E.cpu(), ref.W_E.cpu())


def test_logits_of_every_return_type_and_the_readout_match(pair):
    family, ref, off, dev = pair
    tokens = _tokens(ref)
    sigma = torch.tensor([SIGMA.get(family, 0.7), SIGMA.get(family, 0.7) / 4])
    kinds = RETURN_TYPES.get(family, ("logits", "aligned", "log_probs", "log_softmax")
                             + (("subs",) if family != "duo" else ()))
    with torch.no_grad():
        for kind in kinds:
            a, b = ref(tokens, sigma=sigma, return_type=kind), off(tokens, sigma=sigma, return_type=kind)
            assert a.device == b.device == torch.device(dev) and same(a, b, dev), kind
        assert off(tokens, sigma=sigma, return_type=None) is None
        resid = torch.randn(2, 5, ref.cfg.d_model, generator=torch.Generator().manual_seed(1)).to(dev)
        assert same(ref.readout(resid, sigma=sigma), off.readout(resid, sigma=sigma), dev)
        # the conditioning matters here: another σ gives other logits (else σ reaching a disk block proves little)
        if family != "bd3lm":  # BD3LM's released config is not time-conditioned (σ zeroed, like the reference)
            assert not same(off(tokens, sigma=sigma), off(tokens, sigma=sigma * 0.1), dev)


def test_bd3lm_training_and_kv_cached_forms_match(pair):
    family, ref, off, dev = pair
    if family != "bd3lm":
        pytest.skip("BD3LM's own forward forms")
    n, bs = ref.cfg.n_ctx, ref.cfg.extra["block_size"]
    g = torch.Generator().manual_seed(3)
    x0 = torch.randint(0, 40, (2, n), generator=g).to(dev)
    xt = torch.where(torch.rand(2, n, generator=g).to(dev) < 0.5, ref.cfg.mask_token_id, x0)
    with torch.no_grad():
        assert same(ref(xt, x0=x0, return_type="log_probs"), off(xt, x0=x0, return_type="log_probs"), dev)
        ca, cb = ref.new_kv_cache(2), off.new_kv_cache(2)
        assert all(t.device == torch.device(dev) for t in cb.layers)  # where each block computes
        for b in range(n // bs + 1):  # one block past n: the sliding window moves
            blk = x0[:, (b * bs) % n:(b * bs) % n + bs]
            la = ref(blk, kv_cache=ca, store_kv=True)
            lb = off(blk, kv_cache=cb, store_kv=True)
            assert same(la, lb, dev) and ca.idx == cb.idx
        assert all(same(a, b, dev) for a, b in zip(ca.layers, cb.layers))


def test_every_cached_activation_matches_conditioning_and_adaln_hooks_included(pair):
    family, ref, off, dev = pair
    tokens, sigma = _tokens(ref), SIGMA.get(family, 0.7)
    with torch.no_grad():
        la, ca = ref.run_with_cache(tokens, sigma=sigma)
        lb, cb = off.run_with_cache(tokens, sigma=sigma)
    assert same(la, lb, dev)
    assert sorted(ca.keys()) == sorted(cb.keys())
    for name in ("hook_sigma", "time_embed.hook_freqs", "hook_time_embed", "hook_cond", "blocks.1.adaLN.hook_gate_msa",
                 "blocks.3.adaLN.hook_shift_mlp", "final_adaLN.hook_scale", "ln_final.hook_normalized",
                 "hook_final_modulated", "blocks.1.attn.hook_rot_q"):
        assert name in ca.keys(), name
    assert all(same(ca[k], cb[k], dev) for k in ca.keys())


def _run(model, family: str, settings: dict, edit: bool):
    prompt = torch.tensor([[5, 9, 14, 30]])

    def knock(z, hook):  # a step hook that changes the trajectory: it must act the same on a disk block
        z[:, :, 0] = 0.0
        return z

    hooks = [at_steps(knock, [0, 1], name="blocks.1.attn.hook_z")] if edit else []
    return model.generate(prompt, seed=3, steps=6, gen_length=8, fwd_hooks=hooks, record=[ReceivedAttention()],
                          cache=TrajectoryCache(CACHED, device="cpu"), **settings)


@pytest.mark.parametrize("edit", [False, True])
def test_sampled_tokens_reducers_and_trajectory_cache_match(pair, edit):
    family, ref, off, dev = pair
    for settings in RUNS[family]:
        a, b = _run(ref, family, settings, edit), _run(off, family, settings, edit)
        assert torch.equal(a.tokens.cpu(), b.tokens.cpu()), settings
        ra, rb = a.records["received_attention"], b.records["received_attention"]
        assert ra.shape == rb.shape and near(ra, rb, TRAJECTORY_REL), settings
        assert a.cache.steps == b.cache.steps and len(a.cache.steps) > 1
        for step in a.cache.steps:  # step by step: BD3LM's rows move with its block, and hook_cond has none
            assert a.cache.rows_of(step) == b.cache.rows_of(step)
            for name in CACHED:
                sa, sb = a.cache[step][name], b.cache[step][name]
                assert sa.device.type == sb.device.type == "cpu" and near(sa, sb, TRAJECTORY_REL), (settings, name)


def test_the_step_hook_on_a_disk_block_changes_the_run(pair):
    """The knock-out on the disk-offloaded block 1 takes effect (else the match above proves little)."""
    family, _, off, _ = pair
    for settings in RUNS[family]:
        clean, edited = _run(off, family, settings, False), _run(off, family, settings, True)
        a, b = clean.cache[0][CACHED[0]], edited.cache[0][CACHED[0]]
        assert not near(a, b, 1e-2), settings  # far beyond the numerical tolerance


def test_auto_map_under_a_memory_budget_offloads_whole_blocks(tmp_path):
    """`device_map="auto"` with a CPU budget below the model: accelerate's planner, the DDiT block the unit."""
    folder = str(write("duo", tmp_path / "ckpt"))
    ref = HookedMDM.from_pretrained(folder, load_tokenizer=False)
    total = sum(p.numel() * p.element_size() for p in ref.parameters())
    off = HookedMDM.from_pretrained(folder, load_tokenizer=False, device_map="auto",
                                    max_memory={"cpu": int(total * 0.6)}, offload_folder=tmp_path / "off")
    placed = off.hf_device_map
    assert set(placed.values()) == {"cpu", "disk"}
    # no entry below a block: a block is never split between cpu and disk
    assert not [n for n in placed if n.startswith("blocks.") and n.count(".") > 1]
    assert off.max_memory == {"cpu": int(total * 0.6)}
    tokens = _tokens(ref)
    with torch.no_grad():
        assert same(ref(tokens, sigma=0.5), off(tokens, sigma=0.5), "cpu")
    plan = off.memory_plan(torch.tensor([[5, 9]]), gen_length=6, steps=3)
    assert set(plan.rows) == {"cpu", "disk"} and plan.rows["disk"].weights > 0 and plan.rows["cpu"].streamed > 0
    assert plan.rows["cpu"].weights + plan.rows["disk"].weights == total
    # generate's guard reads max_memory: a batch whose planned run no longer fits the cpu budget is refused
    big = torch.tensor([[5, 9]]).repeat(64, 1)
    over = off.memory_plan(big, gen_length=6, steps=3)
    assert over.rows["cpu"].total > off.max_memory["cpu"] >= plan.rows["cpu"].total - plan.rows["cpu"].activations
    with pytest.raises(MemoryBudgetError, match="would not fit on cpu"):
        off.generate(big, gen_length=6, steps=3)


def test_hookedddit_from_pretrained_takes_a_nested_map_with_the_embedding_on_disk(tmp_path):
    """`HookedDDiT.from_pretrained` directly; a nested map ('' split into its children); the embedding offloaded
    (token ids then go to the execution device, its weight sits on meta)."""
    folder = write("mdlm", tmp_path / "ckpt")
    model = HookedDDiT.from_pretrained(str(folder), load_tokenizer=False, offload_folder=tmp_path / "off",
                                       device_map={"": "cpu", "embed": "disk", "blocks.2": "disk"})
    placed = model.hf_device_map
    assert placed["embed"] == placed["blocks.2"] == "disk" and placed["time_embed"] == placed["blocks.1"] == "cpu"
    assert "" not in placed and model.embed.W_E.device.type == "meta" and model.input_device == torch.device("cpu")
    ref = HookedDDiT.from_pretrained(str(folder), load_tokenizer=False)
    tokens = _tokens(ref)
    with torch.no_grad():
        assert same(ref(tokens, sigma=0.3), model(tokens, sigma=0.3), "cpu")


def test_placement_arguments_are_checked_before_loading(tmp_path):
    folder = str(write("gidd", tmp_path / "ckpt"))
    with pytest.raises(ArgumentError, match="offload_folder"):  # 'disk' without a folder
        HookedMDM.from_pretrained(folder, load_tokenizer=False, device_map=ddit_map("cpu"))
    partial = {k: v for k, v in ddit_map("cpu").items() if k != "time_embed"}
    with pytest.raises(ArgumentError, match=r"without a device, e\.g\. \['time_embed\.fc1\.weight'"):
        HookedMDM.from_pretrained(folder, load_tokenizer=False, device_map=partial)
    with pytest.raises(ArgumentError, match="names modules this model does not have"):
        HookedMDM.from_pretrained(folder, load_tokenizer=False, device_map={"": "cpu", "blocks.9": "cpu"})
    with pytest.raises(ArgumentError, match="only applies with device_map"):
        HookedMDM.from_pretrained(folder, load_tokenizer=False, max_memory={"cpu": 10**9})
    with pytest.raises(ArgumentError, match="n_devices"):
        HookedMDM.from_pretrained(folder, load_tokenizer=False, n_devices=max(2, torch.cuda.device_count() + 1))
    with pytest.raises(ArgumentTypeError, match="device_map"):
        HookedMDM.from_pretrained(folder, load_tokenizer=False, device_map={"embed": 1.5})
    with pytest.raises(ArgumentTypeError, match="offload_folders"):  # a misspelt option is still refused
        HookedDDiT.from_pretrained(str(write("mdlm", tmp_path / "m")), load_tokenizer=False, offload_folders="x")


def test_bd3lm_memory_plan_counts_a_kv_cache_only_when_there_is_one(tmp_path):
    """BD3LM's `kv_cache` is a bool: False is no cache (the plan once counted any value that was not None)."""
    model = HookedMDM.from_pretrained(str(write("bd3lm", tmp_path / "ckpt")), load_tokenizer=False)
    prompt = torch.tensor([[5, 9, 11, 3]])
    kv_of = lambda **kw: sum(r.kv_cache for r in model.memory_plan(prompt, gen_length=8, steps=2, **kw).rows.values())  # noqa: E731
    assert kv_of(kv_cache=False) == 0
    assert kv_of(kv_cache=True) > 0


def test_weight_views_of_offloaded_ddit_modules_are_a_typed_error(tmp_path):
    """`W_E` / `W_U` / `b_U` of an embedding or head on disk refuse naming the module (they were meta tensors);
    resident ones equal the one-device model's."""
    from mdm_lens.errors import OffloadedWeightsError

    folder = str(write("mdlm", tmp_path / "ckpt"))
    ref = HookedMDM.from_pretrained(folder, load_tokenizer=False)
    n = ref.cfg.n_layers
    dmap = {"embed": "disk", "time_embed": "cpu", "final_adaLN": "cpu", "ln_final": "cpu", "unembed": "disk",
            **{f"blocks.{i}": "cpu" for i in range(n)}}
    off = HookedMDM.from_pretrained(folder, load_tokenizer=False, device_map=dmap, offload_folder=tmp_path / "off")
    for view, module in (("W_E", "embed"), ("W_U", "unembed"), ("b_U", "unembed")):
        with pytest.raises(OffloadedWeightsError, match=module):
            getattr(off, view)
    dmap.update(embed="cpu", unembed="cpu", **{"blocks.0": "disk"})
    part = HookedMDM.from_pretrained(folder, load_tokenizer=False, device_map=dmap, offload_folder=tmp_path / "off2")
    for view in ("W_E", "W_U", "b_U"):
        assert torch.equal(getattr(part, view), getattr(ref, view)), view
