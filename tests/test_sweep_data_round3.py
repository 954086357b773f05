"""Sweep data lines a held-out user found read wrongly (round three): gold flags written as 1 / 0 or as strings, a
passage whose text is empty under a title, a lone surrogate escape."""

from __future__ import annotations

import json

import pytest

from mdm_lens.errors import InputError
from mdm_lens.sweep.items import read_items


def _write(tmp_path, *objs_or_lines):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(o if isinstance(o, str) else json.dumps(o) for o in objs_or_lines) + "\n",
                    encoding="utf-8")
    return path


def _item(passages, **kw):
    return {**dict(id="a", question="q?", answers=["x"], ctxs=passages), **kw}


@pytest.mark.parametrize("flag, gold", [(1, (1,)), (True, (1,)), (0, ())])
def test_integer_gold_flags_are_booleans(tmp_path, flag, gold):
    path = _write(tmp_path, _item([{"text": "a", "has_answer": 0}, {"text": "b", "has_answer": flag}]))
    assert read_items(path).items[0].gold_indices == gold


@pytest.mark.parametrize("flag", ["true", 2, [1]])
def test_other_gold_flags_are_refused_naming_line_and_key(tmp_path, flag):
    path = _write(tmp_path, _item([{"text": "a", "has_answer": flag}]))
    with pytest.raises(InputError, match=r"data.jsonl:1: .*has_answer"):
        read_items(path)
    assert "has_answer" in read_items(path, skip_bad=True).skipped[0]["reason"]


def test_a_titled_passage_with_empty_text_is_empty(tmp_path):
    path = _write(tmp_path, _item([{"title": "T", "text": "  "}]))
    with pytest.raises(InputError, match="passage 0 is empty"):
        read_items(path)


def test_a_lone_surrogate_is_refused_at_its_line(tmp_path):
    path = _write(tmp_path, _item(["fine"], id="ok"), '{"id": "b", "question": "x\\ud800y", "answers": ["x"]}')
    with pytest.raises(InputError, match=r"data.jsonl:2: .*surrogate"):
        read_items(path)
    got = read_items(path, skip_bad=True)
    assert [i.id for i in got.items] == ["ok"] and got.skipped[0]["line"] == 2


def test_probes_refuse_strings_as_items_and_an_inert_prompt_length():
    import torch

    from mdm_lens import HookedMDM
    from mdm_lens.errors import ArgumentError, ArgumentTypeError
    from mdm_lens.probes.absorption import absorption_by_layer, final_attention
    from mdm_lens.probes.run import flow_for_items

    model = HookedMDM.from_pretrained("mdm-lens/tiny-mdm")
    with pytest.raises(ArgumentTypeError, match=r"items\[0\].*prompt"):
        flow_for_items(model, ["some text"])
    toks = torch.tensor([[1, 5, 6, 7]])
    for fn in (absorption_by_layer, final_attention):
        with pytest.raises(ArgumentError, match="prompt_length"):
            fn(model, toks, prompt_length=2)
    assert final_attention(model, toks).shape[-1] == 4
