"""The demo end to end on small random stand-in twins (the shipped twins' quality is not the point here)."""

from __future__ import annotations

import re

import torch

import mdm_lens.demo as demo


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
