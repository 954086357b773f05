"""The benchmarks run end to end at a tiny size with one repeat and produce their table.

Nothing about wall time is asserted (the ratios at this size mean nothing); only that every
benchmark runs, the implementations agree (each benchmark checks that before timing) and the
table and results file are written.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

pytest.importorskip("transformers")

ROWS = {
    "forward": ["1 forward"],
    "patterns": ["2 patterns", "(a) vs HF eager", "(b) vs TL TransformerBridge", "(b') causal HookedMDM"],
    "trajectory": ["3 trajectory", "ReceivedAttention() all layers vs no hooks", "extract_full_attention_matrix",
                   "shared-forward recomputation"],
    "memory": ["4 memory", "peak, streaming vs full-pattern cache"],
}


def test_benchmarks_tiny(tmp_path, capsys):
    from benchmarks.__main__ import main

    # one thread: at this size two OpenMP threads only add barrier waits (ms each on a busy machine)
    out = tmp_path / "results.md"
    assert main(["--size", "tiny", "--repeats", "1", "--threads", "1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    text = out.read_text()
    for needles in ROWS.values():
        for needle in needles:
            assert needle in printed and needle in text, needle
    if importlib.util.find_spec("nnsight") is not None:
        assert "(c) vs nnsight" in text
    assert "## Machine and versions" in text and "torch" in text
    assert "| bench | case | ours | theirs | ratio | target | met | note |" in text
    assert "÷ S·L·H·T²·4" in text  # the memory-growth table
    assert "Scaling (item 3)" in text
    # the memory table's held bytes follow the predicted sizes exactly
    mem_rows = [l for l in text.splitlines() if l.startswith("| 12 |") or l.startswith("| 24 |")]
    assert mem_rows and all(l.split("|")[3].strip() == "1.00" and l.split("|")[8].strip() == "1.00"
                            for l in mem_rows)


def test_unknown_benchmark_is_refused(capsys):
    from benchmarks.__main__ import main

    assert main(["--only", "nope", "--out", "-"]) == 2


def test_families2_forward_benchmark_runs_tiny_and_checks_agreement():
    """Issue #30's forward ratios: one tiny round per family, with the logit agreement checked before timing."""
    from benchmarks.bench_families2 import run

    rows = run("tiny", 1)
    assert [r.case.split()[0] for r in rows] == ["rnd1", "coda", "nemotron"]
    assert all(r.ratio > 0 and float(r.note.split()[-1]) <= 1e-3 for r in rows)
