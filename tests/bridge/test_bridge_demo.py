"""The report material for DiffusionGemma: a PNG and a per-step table, labelled random weights."""

from __future__ import annotations

import torch

from mdm_lens.bridge.demo import diffusion_gemma_section


def test_section_material(tmp_path):
    s = diffusion_gemma_section(tmp_path, prompt_length=6, max_new_tokens=16, max_denoising_steps=2)
    assert s.png.exists() and s.png.read_bytes()[:4] == b"\x89PNG"
    assert "RANDOM weights" in s.note and "random weights" in s.title
    assert list(s.table["step"]) == [0, 1, 2, 3] and list(s.table["canvas"]) == [0, 0, 1, 1]
    assert (s.table["accepted"] >= 1).all()
    assert ((s.table["prompt mass"] > 0) & (s.table["prompt mass"] < 1)).all()
    # canvas-0 steps can only attend to prompt + canvas 0 (keys 0..13)
    assert (s.table.loc[s.table["canvas"] == 0, "top key"] < 14).all()
    assert torch.tensor([len(a) for a in s.table["anchors"]]).ge(0).all()
