"""Every HookedMDM family, loaded from a tiny checkpoint in its released layout with a device map that puts blocks
on the accelerator (`--device`, default cpu), on 'cpu' and on 'disk', computes what the resident model computes:
logits, run_with_cache, the family's sampler with step hooks, reducers and a trajectory cache, one probe table.
On CPU the arithmetic is the same, so everything must be bit-identical (see test_device_map.same)."""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "families"))

from loss_family_models import FAMILIES, _checkpoint  # noqa: E402
from test_device_map import mixed_map, same  # noqa: E402

from mdm_lens import HookedMDM, ReceivedAttention, TrajectoryCache, at_steps  # noqa: E402
from mdm_lens.probes.absorption import absorption_by_layer  # noqa: E402

# fastdllm_v2 with its block KV cache: per-layer keys and values are made (and kept) on the layer's device
GEN = {"fastdllm_v2": dict(max_new_tokens=8, small_block_size=2, stop_token=95, pad_id=0,
                       use_block_cache=True)}
CACHED = "blocks.1.hook_resid_post"


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    dev = request.getfixturevalue("test_device")
    root = tmp_path_factory.mktemp(request.param)
    folder = str(_checkpoint(request.param, root / "ckpt"))
    ref = HookedMDM.from_pretrained(folder, load_tokenizer=False, device=dev)
    dm = mixed_map(ref.cfg.n_layers, dev)
    off = HookedMDM.from_pretrained(folder, load_tokenizer=False, device_map=dm, offload_folder=root / "offload")
    assert "disk" in off.hf_device_map.values() and "cpu" in off.hf_device_map.values()
    return request.param, ref, off, dev


def _tokens(model: HookedMDM, n: int = 13) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)  # ids 10..89: no family's mask, pad or eos id (95..100, 0, 1)
    return torch.randint(10, 90, (2, n), generator=g)


def test_logits_and_every_cached_activation_match(pair):
    _, ref, off, dev = pair
    tokens = _tokens(ref)
    with torch.no_grad():
        la, ca = ref.run_with_cache(tokens)
        lb, cb = off.run_with_cache(tokens)
    assert same(la, lb, dev)
    assert sorted(ca.keys()) == sorted(cb.keys())
    assert all(same(ca[k], cb[k], dev) for k in ca.keys())
    assert any(p.device.type == "meta" for p in off.parameters())  # the disk blocks really are offloaded


def _run(model: HookedMDM, family: str, edit: bool):
    prompt = torch.tensor([[5, 9, 14, 30, 8, 21, 7, 11]])

    def knock(z, hook):  # a step hook that changes the trajectory: it must act the same on a disk block
        z[:, :, 0] = 0.0
        return z

    hooks = [at_steps(knock, [0, 1], name="blocks.1.attn.hook_z")] if edit else []  # block 1 is on 'disk'
    kw = GEN.get(family, dict(steps=8, gen_length=8))
    return model.generate(prompt, seed=3, temperature=0.8, fwd_hooks=hooks, record=[ReceivedAttention()],
                          cache=TrajectoryCache([CACHED], device="cpu"), **kw)


@pytest.mark.parametrize("edit", [False, True])
def test_sampler_tokens_reducers_and_cache_match(pair, edit):
    family, ref, off, dev = pair
    a, b = _run(ref, family, edit), _run(off, family, edit)
    assert torch.equal(a.tokens.cpu(), b.tokens.cpu())
    ra, rb = a.records["received_attention"], b.records["received_attention"]
    assert ra.shape == rb.shape and same(ra, rb, dev)
    sa, sb = a.cache.stack(CACHED, align=True), b.cache.stack(CACHED, align=True)
    assert sa.device.type == "cpu" and sb.device.type == "cpu"  # cache_device="cpu" whatever the block's device
    assert same(sa, sb, dev)


def test_step_hook_changes_the_run(pair):
    """The knock-out on the disk-offloaded block 1 takes effect (else the match above proves little)."""
    family, _, off, _ = pair
    clean, edited = _run(off, family, False), _run(off, family, True)
    ra, rb = clean.cache.stack(CACHED, align=True), edited.cache.stack(CACHED, align=True)
    assert not torch.equal(ra[0].nan_to_num(-1.0), rb[0].nan_to_num(-1.0))


def test_absorption_table_matches(pair):
    _, ref, off, dev = pair
    tokens = _tokens(ref, 12)
    ta, tb = absorption_by_layer(ref, tokens).table(), absorption_by_layer(off, tokens).table()
    assert len(ta) > 0
    if dev == "cpu":
        pd.testing.assert_frame_equal(ta, tb, check_exact=True)
    else:
        pd.testing.assert_frame_equal(ta, tb, rtol=1e-5)
