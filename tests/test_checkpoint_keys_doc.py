"""docs/checkpoint_keys.md is generated from the loaders' weight plans (one tiny checkpoint per family, layer 0
and the model-level keys, `{e}` for an expert index): this test fails when a plan changes and the page does not.
Regenerate with `python tests/test_checkpoint_keys_doc.py`."""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "families"))
from family_checkpoints import write_llada2, write_lladamoe, write_sdar  # noqa: E402

from mdm_lens.loading import read_config  # noqa: E402
from mdm_lens.loading.families import family_plan  # noqa: E402
from mdm_lens.loading.hf import hf_plan  # noqa: E402
from mdm_lens.loading.llada import llada_plan  # noqa: E402

DOC = Path(__file__).resolve().parent.parent / "docs" / "checkpoint_keys.md"


def _rows(plan: dict) -> list[str]:
    rows = set()
    for target, sources in plan.items():
        if re.search(r"blocks\.[1-9]", target):
            continue
        t = re.sub(r"experts\.\d+\.", "experts.{e}.", target.replace("blocks.0.", "blocks.{i}."))
        s = [re.sub(r"experts\.\d+\.", "experts.{e}.", re.sub(r"(layers|blocks)\.0\.", r"\1.{i}.", x)) for x in sources]
        rows.add(f"| `{t}` | {' + '.join(f'`{x}`' for x in s)} |")
    return sorted(rows)


def render(tmp: Path) -> str:
    from mdm_lens.config import MDMConfig

    dense = MDMConfig(d_model=8, n_layers=1, n_heads=2, d_mlp=8, d_vocab=8, qkv_bias=True)
    tables = {"LLaDA (`LLaDAModelLM`)": llada_plan(dense, ["model.transformer.wte.weight"]),
              "Llama / Qwen2 / Dream / Fast-dLLM v2": hf_plan(dense, ["model.layers.0.x"])}
    for title, (folder, *_) in {"LLaDA2.x (`LLaDA2MoeModelLM`)": write_llada2(tmp / "a", first_k_dense_replace=0),
                                "LLaDA-MoE (`LLaDAMoEModelLM`)": write_lladamoe(tmp / "b", moe_layer_freq=[1, 1, 1]),
                                "SDAR-MoE (`SDARMoeForCausalLM`)": write_sdar(tmp / "c", moe=True, mlp_only_layers=[]),
                                "SDAR (`SDARForCausalLM`)": write_sdar(tmp / "d")}.items():
        tables[title] = family_plan(read_config(folder, "t", None)[0], [])
    out = ["# Checkpoint key names per family", "",
           "Generated from the loaders' weight plans by `tests/test_checkpoint_keys_doc.py` (which fails when they "
           "drift). Left: the HookedMDM parameter (`{i}` a layer, `{e}` an expert); right: the hub tensors it is "
           "made of (`+`: concatenated along dim 0). Optional rows appear only when config.json enables them "
           "(q/k/v biases, o bias, q/k norms, shared expert, expert bias, untied `lm_head`); a dense layer of a MoE "
           "family uses the dense `mlp.gate_proj/up_proj/down_proj` rows.", ""]
    for title, plan in tables.items():
        out += [f"## {title}", "", "| HookedMDM | checkpoint |", "|---|---|", *_rows(plan), ""]
    return "\n".join(out)


def test_the_doc_matches_the_weight_plans(tmp_path):
    assert DOC.read_text() == render(tmp_path)


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        DOC.write_text(render(Path(d)))
