"""Issue #30's forward ratios for RND1, CoDA and Nemotron-Labs-Diffusion: `model(tokens)` with no hooks against the
plain-torch transcriptions of their references that the exactness tests use (tests/families/rnd1_coda_reference.py,
tests/families/nemotron_fixture.py), on the same random weights written in each hub layout. Logits are checked to
agree before timing (max |Δ| ≤ 1e-3 × the logit scale: at this width the test writers' random weights make the
logits sensitive — Nemotron's own reference moves 5e-4 of scale between fp32 and fp64 — so the 1e-4 exactness
bound is the tests', at their sizes); paired alternating rounds (`benchmarks.harness`).
Target ≤ 1.05.

    python -m benchmarks.bench_families2                    # d_model 256, 4 layers, T 256
    python -m benchmarks.bench_families2 --size tiny --repeats 1
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.harness import Row, alternate, markdown_table, seconds
from mdm_lens import HookedMDM

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "families"))

SIZES = {"full": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                      intermediate_size=688, moe_intermediate_size=128, num_experts=16, num_experts_per_tok=4,
                      max_position_embeddings=1024, seq=256),
         "tiny": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      intermediate_size=64, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
                      max_position_embeddings=128, seq=24)}  # vocab: the writers' 101 ids


def _cases(size: dict, root: Path):
    from nemotron_fixture import reference_forward, write_nemotron
    from rnd1_coda_checkpoints import write_coda, write_rnd1
    from rnd1_coda_reference import coda_forward, rnd1_forward

    keys = {k: v for k, v in size.items() if k != "seq"}
    dense = {k: v for k, v in keys.items() if k not in ("moe_intermediate_size", "num_experts", "num_experts_per_tok")}
    yield "rnd1", write_rnd1(root / "rnd1", **keys), rnd1_forward
    yield "coda", write_coda(root / "coda", **dense), coda_forward
    yield "nemotron", write_nemotron(root / "nemotron", **dense), lambda sd, c, t: reference_forward(sd, c, t)[0]


def run(size: str = "full", repeats: int = 11) -> list[Row]:
    s = SIZES[size]
    rows = []
    with tempfile.TemporaryDirectory(prefix="mdm_fam2_") as tmp, torch.inference_mode():
        for name, (folder, config, sd), ref in _cases(s, Path(tmp)):
            model = HookedMDM.from_pretrained(str(folder), load_tokenizer=False)
            tokens = torch.randint(0, 90, (1, s["seq"]), generator=torch.Generator().manual_seed(0))
            ours, theirs = model(tokens), ref(sd, config, tokens)
            err = float((ours - theirs).abs().max()) / max(1.0, float(theirs.abs().max()))
            if err > 1e-3:
                raise AssertionError(f"{name}: logits differ from the reference by {err:.2e} of scale")
            t = alternate(lambda: model(tokens), lambda: ref(sd, config, tokens), repeats)
            ratio = t.ratio
            rows.append(Row("families2 forward", f"{name} model(tokens) vs reference transcription, T {s['seq']}",
                            seconds(t.a_med), seconds(t.b_med), ratio, "≤ 1.05", ratio <= 1.05,
                            f"max rel err {err:.1e}"))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=sorted(SIZES), default="full")
    p.add_argument("--repeats", type=int, default=11)
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    rows = run(args.size, args.repeats)
    print(markdown_table(["bench", "case", "ours", "theirs", "ratio", "target", "met", "note"], [r.cells() for r in rows]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
