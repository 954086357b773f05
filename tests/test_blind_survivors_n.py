"""Blind list N: the mutations the whole suite let through, each pinned with a planted case and its exact answer."""

from __future__ import annotations

import json

import pandas as pd
import torch

from mdm_lens import HookedMDM
from mdm_lens.hooks.reducers import ReceivedAttention


def test_an_arm_runs_key_at_prompt_plus_s_is_invisible_at_step_s_even_in_a_record_without_nan():
    # At ARM step s the forward's input is prompt + s tokens: key prompt + s does not exist yet. The reducer writes
    # NaN there, but the documented rule (j < prompt_length + s) must hold on its own, e.g. for a record that
    # stores 0 at absent keys (an older record, a user's reducer): survivor run-step-visibility-includes-future-key.
    from mdm_lens.probes import run as R

    arm = HookedMDM.from_pretrained("mdm-lens/tiny-arm")
    P, G = 5, 4
    out = arm.generate(torch.tensor([[7, 8, 9, 10, 11]]), steps=G, gen_length=G, record=[ReceivedAttention()])
    out.records["received_attention"] = out.records["received_attention"].nan_to_num(0.0)
    res = R.anchors_over_steps(out, layer=-1)
    keys = torch.arange(P + G)
    want = torch.stack([keys < P + s for s in res.steps])[None]          # [batch, step, key]
    assert res.steps == list(range(G)) and torch.equal(res.key_visible, want)
    assert not res.anchors[..., P + torch.tensor(res.steps)[:, None] <= keys].any()


def test_the_first_sweep_folder_holding_a_table_provides_it(tmp_path):
    # "the first folder holding a table provides it" (a knockout sweep on fewer items beside the main one):
    # survivor sweep-report-table-from-last-folder read the last folder's table
    from mdm_lens.views.sweep_report import Sweep

    roots = []
    for i, value in enumerate((0.25, 0.75)):
        root = tmp_path / f"s{i}"
        root.mkdir()
        (root / "manifest.json").write_text(json.dumps({"model": {"id": "org/model"}}))
        pd.DataFrame({"item_id": ["a"], "value": [value]}).to_parquet(root / "mytable.parquet")
        roots.append(root)
    (roots[1] / "only_here.parquet").write_bytes((roots[1] / "mytable.parquet").read_bytes())
    sweep = Sweep(roots)
    assert sweep.table("mytable")["value"].tolist() == [0.25]
    assert sweep.table("only_here")["value"].tolist() == [0.75]
    assert sweep.table("absent") is None


def test_the_explorers_inline_data_cannot_close_its_script_element():
    # a token string or title holding "</script>" must not end the JSON <script> early (the page would break and
    # the rest would be read as HTML): survivor explore-json-script-close-unescaped
    from mdm_lens.views.explore import Explorer

    ex = Explorer(data=[{"tokens": ["a", "</script><b>x</b>"]}], title="t </script>", notes=["</p>"])
    html = ex.fragment()
    script = html.split('type="application/json"', 1)[1].split(">", 1)[1]
    body = script.split("</script>", 1)[0]  # where the browser ends the element
    assert json.loads(body) == {"runs": [{"tokens": ["a", "</script><b>x</b>"]}], "title": "t </script>",
                                "notes": ["</p>"]}


def test_prompt_length_zero_is_refused_off_diffusion_gemma_as_any_other_value():
    # 0 is a value, not "unset": on a model whose clean forward has one query per position it would be ignored
    # (survivor ignored-prompt-length-zero-passes)
    import pytest

    from mdm_lens.errors import ArgumentError
    from mdm_lens.probes import run as R

    model = HookedMDM.from_pretrained("mdm-lens/tiny-mdm")
    toks = torch.tensor([[7, 8, 9, 10, model.cfg.mask_token_id]])
    for call in (lambda: R.absorption_by_layer(model, toks, prompt_length=0),
                 lambda: R.qk_at_layer(model, toks, layer=1, prompt_length=0)):
        with pytest.raises(ArgumentError, match="prompt_length=0 is ignored") as e:
            call()
        assert e.value.argument == "prompt_length"


def test_schema_conform_refuses_a_column_declared_only_for_another_table():
    # every table's columns are its own: a column the schema declares for another table (a qk column in the
    # absorption table) must not reach the file undocumented (survivor schema-conform-accepts-other-tables-columns)
    import pytest

    from mdm_lens.errors import ArgumentError
    from mdm_lens.sweep import schema

    own, other = set(schema.table_columns("absorption")), set(schema.table_columns("qk"))
    foreign = sorted(other - own)[0]
    df = pd.DataFrame({"item_id": ["a"], "value": [0.5], foreign: [1]})
    with pytest.raises(ArgumentError, match=f"has columns \\['{foreign}'\\]"):
        schema.conform("absorption", df)
    assert schema.conform("absorption", df.drop(columns=[foreign]))["value"].tolist() == [0.5]


def test_a_section_title_is_escaped_in_its_heading_as_in_the_contents(tmp_path):
    # survivor report-section-title-unescaped: the <h2> took the title raw (the table of contents escaped it)
    from mdm_lens.views.report import Section, write_report

    title = "A <b>bold</b> & <script>x</script> claim"
    page = write_report(tmp_path / "r", "Report", [Section(title=title, text="body")]).read_text()
    escaped = "A &lt;b&gt;bold&lt;/b&gt; &amp; &lt;script&gt;x&lt;/script&gt; claim"
    assert f"<h2>1. {escaped}</h2>" in page and "<script>x</script>" not in page


def test_sdar_moe_defaults_to_the_sdar_sampler(tmp_path):
    # survivor generate-sdar-moe-default-sampler (timed out: LLaDA's sampler ran in its place)
    from mdm_lens.diffusion.generate import default_sampler
    from tests.test_misuse_round4a import _family

    model = _family("sdar_moe", tmp_path)
    assert model.cfg.family == "sdar_moe" and default_sampler(model) == "sdar"
    out = model.generate(torch.tensor([[3, 9, 4, 17, 8]]), gen_length=8, block_length=4)
    assert out.sampler == "sdar"
