"""Smoke tests of examples/10_sae_steps.py and examples/11_sae_lens_runner.py: each main() with tiny settings,
checked on invariants (the bands partition the steps, every visible position of every step is one row, TopK's
L0 <= k, the runner's mask-rate band). Run on one intra-op thread: these are thousands of tiny ops, which a
thread pool only slows down on a shared CPU."""

import importlib
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture
def examples_path():
    sys.path.insert(0, str(EXAMPLES))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
        sys.path.remove(str(EXAMPLES))


def _visible_rows(n: int, n_steps: int) -> int:
    """Rows per step of example 10's trajectories: the prompts' real tokens plus the canvas, per item."""
    from mdm_lens import HookedMDM
    from mdm_lens.zoo import data as D

    model = HookedMDM.from_pretrained("mdm-lens/tiny-mdm")
    _, am = model.to_tokens([it.prompt for it in D.make_dataset(n, seed=7, n_distractors=4)],
                            return_attention_mask=True)
    return int(am.sum()) + n * n_steps


def _check(result: dict, n: int, n_steps: int, n_bands: int, k: int) -> None:
    bands = result["bands"]
    assert [s for b in range(n_bands) for s in bands[b]["steps"]] == list(range(n_steps))
    per_step = _visible_rows(n, n_steps)
    for b in range(n_bands):
        stats = bands[b]
        assert stats["rows"] == per_step * len(stats["steps"])
        assert 0 < stats["l0"] <= k and 0 <= stats["anchors"] <= stats["rows"]
        rates = stats["table"][["on_anchors", "elsewhere", "same_token_elsewhere"]].to_numpy()
        assert ((rates >= 0) & (rates <= 1)).all()
    assert result["overlap"].shape == (n_bands, n_bands)


def test_example_10_sae_per_step_band(examples_path):
    ex = importlib.import_module("10_sae_steps")
    result = ex.main(n=4, n_steps=2, n_bands=2, d_sae=32, k=4, n_updates=5)
    _check(result, n=4, n_steps=2, n_bands=2, k=4)


@pytest.mark.skipif(importlib.util.find_spec("sae_lens") is None or importlib.util.find_spec("datasets") is None,
                    reason="sae-lens / datasets not installed (the transformer-lens 3.x venv runs this)")
def test_example_11_sae_lens_runner(examples_path):
    ex = importlib.import_module("11_sae_lens_runner")
    result = ex.main(n=4, n_steps=2, n_bands=2, d_sae=32, k=4, tokens=1024, n_text=64)
    _check(result, n=4, n_steps=2, n_bands=2, k=4)
    # step 0 of 2 trains on fully masked text, step 1 on half-masked text
    assert [result["bands"][b]["rates"] for b in range(2)] == [(1.0, 1.0), (0.5, 0.5)]
