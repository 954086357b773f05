"""Exactness: every family, written in its real on-disk format, loaded by `from_pretrained`, must give
the logits of an independent implementation (transformers' Llama/Qwen2, non-causal for the MDMs)."""

from __future__ import annotations

import pytest
import torch

from mdm_lens import HookedMDM
from tiny_checkpoints import hf_reference, write_bin, write_dream, write_hf, write_llada

TOL = 1e-4
FAMILIES = ["llada", "dream", "llama", "qwen2"]
WRITERS = {"llada": write_llada, "dream": write_dream, "llama": write_hf, "qwen2": write_hf}


def _ref_logits(ref, family, tokens, attention_mask=None, position_ids=None):
    causal = family in ("llama", "qwen2")
    with torch.no_grad():
        logits = ref(tokens, attention_mask=attention_mask, position_ids=position_ids, is_causal=causal).logits
    if family == "dream":  # the sampler's alignment: hidden i-1 predicts token i
        logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
    return logits


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("n_kv_heads", [4, 2])
@pytest.mark.parametrize("sharded", [False, True])
def test_logits_match_transformers(tmp_path, family, n_kv_heads, sharded):
    ref = hf_reference(family, n_kv_heads=n_kv_heads)
    folder = WRITERS[family](ref, tmp_path / family, sharded=sharded)
    if sharded:
        assert any(p.name.endswith(".index.json") for p in folder.iterdir())
    model = HookedMDM.from_pretrained(str(folder))
    assert model.cfg.family == family and model.cfg.n_key_value_heads == n_kv_heads
    tokens = torch.randint(0, 90, (3, 13))
    with torch.no_grad():
        ours = model(tokens, return_type="aligned")
    diff = (ours - _ref_logits(ref, family, tokens)).abs().max().item()
    assert diff <= TOL, f"{family}: max |Δlogit| = {diff:.2e}"


@pytest.mark.parametrize("family", FAMILIES)
def test_left_padding_matches_transformers(tmp_path, family):
    """Key-padding (LLaDA, ARMs) and Dream's pair mask + cumsum positions, compared on real rows."""
    ref = hf_reference(family, n_kv_heads=2)
    model = HookedMDM.from_pretrained(str(WRITERS[family](ref, tmp_path / family)))
    tokens = torch.randint(2, 90, (2, 10))
    am = torch.ones_like(tokens)
    am[0, :3] = 0
    tokens[0, :3] = 1  # pad id, never the mask id
    position_ids = None
    if family == "dream":  # HF does not derive Dream's positions from the mask; the sampler passes them
        position_ids = (am.cumsum(-1) - 1).masked_fill(am == 0, 1)
    ref_logits = _ref_logits(ref, family, tokens, attention_mask=am, position_ids=position_ids)
    with torch.no_grad():
        ours = model(tokens, attention_mask=am, return_type="aligned")
    valid = am.bool()
    if family == "dream":  # the first real token's aligned logit comes from a pad row: compare from the 2nd
        valid[0, 3] = False
    diff = (ours - ref_logits)[valid].abs().max().item()
    assert diff <= TOL, f"{family} padded: {diff:.2e}"
    # padding really is masked: changing pad tokens does not move real rows
    tokens2 = tokens.clone()
    tokens2[0, :3] = 5
    with torch.no_grad():
        ours2 = model(tokens2, attention_mask=am, return_type="aligned")
    assert (ours2 - ours)[valid].abs().max().item() < 1e-5


def test_bin_format_loads_with_weights_only(tmp_path):
    ref = hf_reference("llama")
    model = HookedMDM.from_pretrained(str(write_bin(ref, tmp_path / "bin")))
    tokens = torch.randint(0, 90, (1, 9))
    with torch.no_grad():
        assert (model(tokens) - _ref_logits(ref, "llama", tokens)).abs().max() <= TOL


def test_mdm_is_bidirectional_and_arm_is_causal(tmp_path):
    """The first position must see the last token in an MDM and must not in an ARM."""
    for family, expect_change in (("llada", True), ("llama", False)):
        ref = hf_reference(family)
        model = HookedMDM.from_pretrained(str(WRITERS[family](ref, tmp_path / family)))
        a = torch.randint(0, 90, (1, 8))
        b = a.clone()
        b[0, -1] = (a[0, -1] + 1) % 90
        with torch.no_grad():
            moved = (model(a)[0, 0] - model(b)[0, 0]).abs().max().item()
        assert (moved > 1e-4) == expect_change, (family, moved)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_bf16_path_runs_and_tracks_fp32(tmp_path, family):
    ref = hf_reference(family)
    folder = WRITERS[family](ref, tmp_path / family)
    m32 = HookedMDM.from_pretrained(str(folder))
    m16 = HookedMDM.from_pretrained(str(folder), dtype=torch.bfloat16)
    assert m16.W_E.dtype == torch.bfloat16
    tokens = torch.randint(0, 90, (2, 12))
    with torch.no_grad():
        l32, l16 = m32(tokens), m16(tokens)
    assert l16.dtype == torch.bfloat16 and torch.isfinite(l16).all()
    assert (l16.float() - l32).abs().max() < 0.1  # bf16 noise, not a different model
