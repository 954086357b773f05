"""The demo end to end on small random stand-in twins (the shipped twins' quality is not the point here)."""

from __future__ import annotations

import re

import pytest
import torch

import mdm_lens.demo as demo
from mdm_lens import HookedMDM, MDMConfig
from mdm_lens.loading import save_pretrained
from mdm_lens.zoo import tokenizer as ZT


@pytest.fixture
def twins(tmp_path, monkeypatch):
    names = {}
    for kind, attention in (("MDM", "bidirectional"), ("ARM", "causal")):
        cfg = MDMConfig(d_model=32, n_layers=2, n_heads=2, d_mlp=64, d_vocab=ZT.vocab_size(), n_ctx=128,
                        attention=attention, mask_token_id=ZT.MASK_ID, bos_token_id=ZT.BOS_ID,
                        eos_token_id=ZT.EOS_ID, pad_token_id=ZT.PAD_ID, family="mdm_lens",
                        model_name=f"stand-in-{kind.lower()}", extra={"gen_length": 4, "prepend_bos": False})
        model = HookedMDM.from_config(cfg, seed=0, init_std=0.2, tokenizer=ZT.load_tokenizer())
        names[kind] = str(save_pretrained(model, tmp_path / kind))
    monkeypatch.setattr(demo, "TWINS", names)
    return names


def test_demo_writes_an_offline_report(tmp_path, twins, capsys):
    torch.manual_seed(0)
    index = demo.run_demo(str(tmp_path / "report"), n=2)
    html = index.read_text()
    for title in ("QA accuracy", "Absorption by layer", "Temporal floating", "QK decomposition", "Retrieval heads",
                  "Region-level attention flow", "Anchor knockout", "Interactive attention"):
        assert title in html
    images = re.findall(r'<img[^>]+src="([^"]+)"', html)
    assert len(images) >= 10 and all((index.parent / src).stat().st_size > 1000 for src in images)
    assert not re.search(r'<script[^>]+src="https?://', html)
    assert "[4/4]" in capsys.readouterr().out  # progress is shown
