"""The same bridge on tiny Llama/Qwen2 checkpoints agrees with the native `HookedMDM` (≤1e-5, fp32):
logits and every shared hook point, bidirectional (LLaDA/Dream-style) and causal."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

from mdm_lens import HookedMDM
from mdm_lens.bridge import TransformersBridge

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tiny_checkpoints import hf_reference, write_hf  # noqa: E402

SHARED = ["hook_embed", "blocks.1.hook_resid_pre", "blocks.0.attn.hook_q", "blocks.0.attn.hook_k",
          "blocks.0.attn.hook_rot_q", "blocks.0.attn.hook_rot_k", "blocks.0.attn.hook_v",
          "blocks.1.attn.hook_attn_scores", "blocks.1.attn.hook_pattern", "blocks.1.attn.hook_z",
          "blocks.0.hook_attn_out", "blocks.0.hook_resid_mid", "blocks.1.mlp.hook_pre", "blocks.1.mlp.hook_post",
          "blocks.1.hook_mlp_out", "blocks.1.hook_resid_post"]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("causal", [True, False])
def test_bridge_agrees_with_hooked_mdm(tmp_path, family, causal):
    ref = hf_reference(family, n_kv_heads=2)
    ref.config.is_causal = causal
    native = HookedMDM.from_pretrained(str(write_hf(ref, tmp_path / family)))
    native.cfg.attention = "causal" if causal else "bidirectional"
    bridge = TransformersBridge(copy.deepcopy(ref))
    assert bridge.cfg.attention == native.cfg.attention
    tokens = torch.randint(0, 90, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, ca = native.run_with_cache(tokens)
        b, cb = bridge.run_with_cache(tokens)
    assert (a - b).abs().max().item() <= 1e-5
    for name in SHARED:
        x, y = ca[name], cb[name]
        assert x.shape == y.shape, name
        if name.endswith("hook_attn_scores"):  # masked entries: -inf (native) vs the dtype minimum (eager's rule)
            visible = torch.isfinite(x)
            x, y = x[visible], y[visible]
        assert (x - y).abs().max().item() <= 1e-5, name
    pattern = cb["blocks.1.attn.hook_pattern"]
    upper = pattern.triu(1).abs().sum().item()
    assert (upper == 0.0) == causal  # causal really masks the future; bidirectional really does not
