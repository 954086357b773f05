"""`python -m benchmarks --only ddit` runs at the tiny size: HookedDDiT agrees with the benchmark's reference
transcription before anything is timed, and the table names both comparisons. No wall time is asserted."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def test_ddit_benchmark_tiny(tmp_path, capsys):
    from benchmarks.__main__ import main

    out = tmp_path / "results.md"
    assert main(["--size", "tiny", "--only", "ddit", "--repeats", "1", "--threads", "1", "--out", str(out)]) == 0
    text = out.read_text()
    for needle in ("mdlm HookedDDiT vs reference transcription", "duo HookedDDiT vs reference transcription",
                   "a hook on every block at every step vs none", "max rel err"):
        assert needle in text, needle


def test_the_benchmark_reference_is_the_model(tmp_path):
    import torch

    from benchmarks.bench_ddit import SIZES, _model, reference_forward

    m = _model("duo", SIZES["tiny"])
    x = torch.randint(0, 60, (2, 16), generator=torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.2, 3.0])
    ref = reference_forward(m, x, sigma)
    torch.testing.assert_close(m(x, sigma=sigma), ref, rtol=0, atol=1e-5 * float(ref.detach().abs().max()))
    far = reference_forward(m, x, torch.tensor([6.0, 0.01]))  # σ reaches the transcription (100× the tolerance)
    assert (far - ref).abs().max() > 1e-3 * float(ref.detach().abs().max())
