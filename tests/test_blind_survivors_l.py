"""Blind list L (audit/2026-12-05c/blindL.json): the mutations the whole suite let through, each pinned here by a
planted case with the exact answer."""

from __future__ import annotations

import pytest

from mdm_lens import HookedMDM
from mdm_lens.hooks.plan import COLUMNS, DeviceMemory


def test_a_device_total_counts_every_column_the_streamed_module_too():
    row = DeviceMemory("cuda:0", weights=1, streamed=20, activations=300, kv_cache=4000, caches=50000)
    assert row.total == 54321 and set(COLUMNS) == {"weights", "streamed", "activations", "kv_cache", "caches"}
    # an offloaded run whose streamed module alone passes the budget does not fit
    assert not DeviceMemory("cuda:0", weights=10, streamed=95, budget=100).fits
    assert DeviceMemory("cuda:0", weights=10, streamed=90, budget=100).fits


def test_to_tokens_pads_with_the_pad_id_before_eos():
    m = HookedMDM.from_pretrained("mdm-lens/tiny-mdm")
    assert m.cfg.pad_token_id != m.cfg.eos_token_id  # the twin has both: the pad id must win
    pad = m.cfg.pad_token_id
    ids, am = m.to_tokens(["where is ketterby ?", "a"], return_attention_mask=True, padding_side="right")
    assert (ids[am == 0] == pad).all() and (am == 0).any()
    m.cfg.pad_token_id = None  # no pad id: eos stands in
    ids, am = m.to_tokens(["where is ketterby ?", "a"], return_attention_mask=True, padding_side="right")
    assert (ids[am == 0] == m.cfg.eos_token_id).all()


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_side_places_the_pads(side):
    m = HookedMDM.from_pretrained("mdm-lens/tiny-mdm")
    ids, am = m.to_tokens(["where is ketterby ?", "a"], return_attention_mask=True, padding_side=side)
    row = am[1].tolist()
    assert row == sorted(row) if side == "left" else row == sorted(row, reverse=True)


def test_the_sweeps_knockout_scores_the_first_gold_answer(monkeypatch):
    # an item's answers list its gold first (the one the render checks against gen_length); aliases follow
    from types import SimpleNamespace

    import pandas as pd

    from mdm_lens.sweep import adapter as A

    seen = []

    class Result:
        def to_frame(self):
            return pd.DataFrame({"metric": ["effect"], "value": [0.0]})

    def spy(model, ids, answer=None, **kw):
        seen.append(answer)
        return Result()

    monkeypatch.setattr(A.patching, "knockout", spy)
    m = HookedMDM.from_pretrained("mdm-lens/tiny-mdm")
    item = SimpleNamespace(item=SimpleNamespace(answers=("gold", "alias one", "alias two")), ids=[5, 6, 7])
    none = SimpleNamespace(item=SimpleNamespace(answers=()), ids=[5, 6])
    batch = SimpleNamespace(rendered=[item, none], item_ids=["a", "b"], seeds=[0, 1])
    A.knockout(m, batch, A.Settings(gen_length=4, steps=4, block_length=None), {})
    assert seen == ["gold", None]


LLADA_BIG_VOCAB = {  # read_config only: no weights, so the released vocabulary's size costs nothing
    "architectures": ["LLaDAModelLM"], "model_type": "llada", "d_model": 32, "n_heads": 4, "n_kv_heads": 4,
    "n_layers": 2, "mlp_hidden_size": 64, "mlp_ratio": 4, "vocab_size": 126464, "embedding_size": 126464,
    "max_sequence_length": 256, "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "include_qkv_bias": False,
    "weight_tying": False, "activation_type": "silu", "block_type": "llama", "layer_norm_type": "rms",
    "rope": True, "rope_full_precision": True, "alibi": False, "layer_norm_with_affine": True,
    "bias_for_layer_norm": False, "attention_layer_norm": False, "include_bias": False, "scale_logits": False,
    "input_emb_norm": False, "block_group_size": 1, "multi_query_attention": None,
}


@pytest.mark.parametrize("given", [dict(pad_token_id=7), dict(mask_token_id=9, bos_token_id=11),
                                   dict(pad_token_id=7, mask_token_id=9, bos_token_id=11)])
def test_family_default_ids_fill_only_what_config_json_lacks(tmp_path, given):
    import json

    from mdm_lens.loading import read_config

    (tmp_path / "config.json").write_text(json.dumps({**LLADA_BIG_VOCAB, **given}))
    cfg, family = read_config(tmp_path, "local", None)
    defaults = dict(mask_token_id=126336, bos_token_id=126080, pad_token_id=126081)  # LLaDA's released ids
    assert family == "llada"
    for key, default in defaults.items():
        assert getattr(cfg, key) == given.get(key, default), key


def test_an_item_whose_prompt_fits_but_not_with_its_answer_is_flagged_before_the_sweep():
    from types import SimpleNamespace

    from mdm_lens.sweep.checks import render_problems

    m = HookedMDM.from_pretrained("mdm-lens/tiny-mdm")
    n = m.cfg.n_ctx
    item = SimpleNamespace(gold_indices=(), passages=(), is_qa=False, answers=())

    def problems(prompt_tokens, gen):
        r = SimpleNamespace(ids=[5] * prompt_tokens, item=item, dropped=(), qa=None)
        return [p for p in render_problems(m, r, [], gen, set()) if "context" in p]

    assert problems(n - 8, 8) == []                                   # exactly fills the context
    assert problems(n - 8, 9) == [f"{n - 8} prompt tokens + gen_length 9 exceed the model's context of {n}"]
    assert problems(n, 1) != [] and problems(4, 8) == []


# --- blind list M (audit/2026-12-05c/blindM.json) survivors ------------------------------------------------------

@pytest.mark.parametrize("href", ["javascript:alert(1)", "JavaScript:alert(1)", "JAVASCRIPT:x"])
def test_report_markdown_drops_javascript_links_and_keeps_the_rest(href):
    from mdm_lens.views.report import markdown_lite

    html = markdown_lite(f"see [the docs](https://example.org/a) and [this]({href}) here")
    assert '<a href="https://example.org/a">the docs</a>' in html
    assert "javascript" not in html.lower() and "this" in html


@pytest.mark.parametrize("steps", [1, 2, 3])
def test_dream_origin_commits_every_mask_at_its_last_step(steps):
    # the reference forces p_transfer = 1 at the last step; 1 − s/t there leaves masks (eps = 0.9: 90 % of them)
    import torch

    from mdm_lens import MDMConfig

    m = HookedMDM.from_config(MDMConfig(d_model=32, n_layers=2, n_heads=4, d_mlp=64, d_vocab=50, n_ctx=64,
                                        mask_token_id=49, pad_token_id=0, eos_token_id=2, logit_shift=True,
                                        model_name="dream-like"), seed=0)

    def no_mask(module, args, out):
        out = out.clone()
        out[..., 49] = -1e4
        return out

    handle = m.unembed.register_forward_hook(no_mask)
    try:
        out = m.generate(torch.tensor([[1, 5, 6, 7]]), sampler="dream", gen_length=12, steps=steps, eps=0.9,
                         alg="origin", seed=0)
    finally:
        handle.remove()
    assert not (out.tokens == 49).any()
    assert (out.trajectory.commit_step[0, 4:] >= 0).all() and (out.trajectory.commit_step[0, 4:] < steps).all()


def test_report_markdown_escapes_html_in_every_block():
    from mdm_lens.views.report import markdown_lite

    html = markdown_lite("a <script>x()</script> & b\n\n- item <b>\n\n## head <i>\n\n1. one <u>")
    assert "<script>" not in html and "&lt;script&gt;" in html and "&amp;" in html
    for tag in ("b", "i", "u"):  # the text holds no bold / italic markup: any raw tag came through unescaped
        assert f"&lt;{tag}&gt;" in html and f"<{tag}>" not in html, tag
