"""`--dtype bfloat16` (what a GPU node runs) on the CPU: the sweep loads the model in bf16, records it, and its
statistics stay finite and close to the fp32 sweep on the same items (reductions run in fp64 either way)."""

from __future__ import annotations

import json

import numpy as np

from mdm_lens import sweep
from mdm_lens.zoo import jsonl


def test_bfloat16_sweep_is_recorded_finite_and_close_to_fp32(tmp_path):
    data = tmp_path / "items.jsonl"
    jsonl.export(data, 3, seed=34)
    tabs = {}
    for dtype in ("float32", "bfloat16"):
        tabs[dtype] = sweep.run("mdm-lens/tiny-mdm", data, "absorption,qk", tmp_path / dtype, dtype=dtype,
                                progress=False)
        manifest = json.loads((tmp_path / dtype / "manifest.json").read_text())
        assert manifest["arguments"]["dtype"] == dtype
    keys = ["item_id", "mode", "variant", "layer", "metric"]
    a32 = tabs["float32"]["absorption"]
    a16 = tabs["bfloat16"]["absorption"]
    merged = a32.merge(a16, on=[k for k in keys if k in a32.columns], suffixes=("_32", "_16"))
    assert len(merged) == len(a32) == len(a16) > 0
    v32, v16 = merged.filter(like="value_32").to_numpy(float), merged.filter(like="value_16").to_numpy(float)
    assert np.isfinite(v16).all()
    # bf16 keeps ~3 significant digits: absorption percentages agree to a few points, and rank the same way
    assert np.abs(v32 - v16).max() < 5.0
    assert np.corrcoef(v32.ravel(), v16.ravel())[0, 1] > 0.98
    qk = tabs["bfloat16"]["qk"]
    share = qk["metric"].isin(["norm_share", "angle_share"])
    assert np.isfinite(qk.loc[~share, "value"].to_numpy(float)).all()
    # the shares N/Δ, G/Δ are NaN exactly where the head has no advantage (Δ ≤ 0), finite elsewhere
    adv = qk[qk["metric"] == "advantage"].set_index(["item_id", "layer", "head"])["value"]
    for metric in ("norm_share", "angle_share"):
        sh = qk[qk["metric"] == metric].set_index(["item_id", "layer", "head"])["value"]
        assert (sh.isna() == (adv.reindex(sh.index) <= 0)).all()
