"""mdm_lens.views: figures write PNGs, reports are portable and offline, circuitsvis views work."""

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from matplotlib.figure import Figure

from mdm_lens import HookedMDM, InputError, MDMConfig, steps
from mdm_lens import views
from mdm_lens.views import circuits, figures

PNG = b"\x89PNG\r\n\x1a\n"
rng = np.random.default_rng(0)


def _png_ok(path: Path) -> bool:
    return path.is_file() and path.stat().st_size > 2000 and path.read_bytes()[:8] == PNG


def _temporal():
    S, T = 10, 16
    rec = rng.dirichlet(np.ones(T), size=S)
    rec[:, 3] += 0.5
    rec /= rec.sum(1, keepdims=True)
    anchors = rec > rec.mean(1, keepdims=True) + 3 * rec.std(1, keepdims=True)
    commit = np.r_[np.full(8, -1), np.arange(8)]
    return rec, anchors, commit


def _qk(T=12):
    q, k = rng.normal(size=(T, 8)), rng.normal(size=(T, 8))
    nq, nk = np.linalg.norm(q, axis=1), np.linalg.norm(k, axis=1)
    return q @ k.T, (q @ k.T) / np.outer(nq, nk), np.outer(nq, nk)


FIGURES = {
    "absorption": lambda p: figures.absorption_by_layer(
        {"tiny-mdm": (rng.uniform(5, 30, 6), rng.uniform(1, 5, 6)), "tiny-arm": (rng.uniform(50, 90, 6), None)},
        {"tiny-mdm": 2.0, "tiny-arm": np.full(6, 9.0)}, "absorption", path=p),
    "absorption_no_null": lambda p: figures.absorption_by_layer({"LLaDA": (torch.rand(4) * 30, torch.rand(4))},
                                                                None, "absorption", path=p),
    "temporal": lambda p: figures.temporal_heatmap(*_temporal()[:2], [f"t{i}" for i in range(16)], "temporal",
                                                   path=p, committed_step=_temporal()[2], prompt_length=8),
    "temporal_log": lambda p: figures.temporal_heatmap(torch.rand(5, 7), None, None, "t", path=p, scale="log"),
    "qk": lambda p: figures.qk_maps(*_qk(), [3], "qk", path=p),
    "qk_causal": lambda p: figures.qk_maps(*_qk(), [0, 5], "qk", causal=True, path=p),
    "qk_bars": lambda p: figures.qk_decomposition_bars(rng.normal(size=6), rng.normal(1, 1, 6),
                                                       [f"H{h}" for h in range(6)], "bars", path=p),
    "retrieval": lambda p: figures.retrieval_heatmap(rng.random((6, 8)) ** 3, "retrieval", path=p),
    "flow": lambda p: figures.region_flow({"gold@1": rng.dirichlet(np.ones(6)), "gold@4": rng.dirichlet(np.ones(6))},
                                          ["BOS", "Query", "Doc1", "Doc2", "Doc3", "Answer"],
                                          {"gold@1": 2, "gold@4": 4}, "flow", path=p),
    "flow_bars": lambda p: figures.region_flow({"first": rng.random(4), "last": rng.random(4)},
                                               ["BOS", "D1", "D2", "A"], {"first": 1, "last": 2}, "flow",
                                               path=p, kind="bars"),
    "knockout": lambda p: figures.knockout_effect(["L0", "L1", "L2"], [0.3, 0.1, 0.2], [0.01, 0.02, 0.0],
                                                  [0.05] * 3, [0.01] * 3, "Δ accuracy", "knockout", path=p),
    "accuracy": lambda p: figures.accuracy_curves([1, 3, 5], {"MDM + context": [0.6, 0.55, 0.5],
                                                              "MDM no context": [0.1] * 3,
                                                              "ARM + context": [0.5, 0.4, 0.3]},
                                                  "#documents", "acc", path=p),
    "accuracy_categorical": lambda p: figures.accuracy_curves(["first", "middle", "last"],
                                                              {"LLaDA": [0.5, 0.5, 0.5], "Llama": [0.5, 0.3, 0.4]},
                                                              "gold position", "acc", path=p),
}


@pytest.mark.parametrize("name", list(FIGURES))
def test_figure_writes_png(name, tmp_path):
    path = tmp_path / "sub" / f"{name}.png"
    fig = FIGURES[name](path)
    assert isinstance(fig, Figure)
    assert _png_ok(path)


def test_figure_without_path_returns_figure(tmp_path):
    fig = figures.retrieval_heatmap(np.zeros((2, 3)), "x")
    assert isinstance(fig, Figure) and not list(tmp_path.iterdir())


def test_figure_shape_errors():
    with pytest.raises(ValueError, match="anchors"):
        figures.temporal_heatmap(np.zeros((3, 4)), np.zeros((3, 5), bool), None, "x")
    with pytest.raises(ValueError):
        figures.qk_maps(np.zeros((3, 3)), np.zeros((3, 3)), np.zeros((4, 4)), [], "x")
    with pytest.raises(ValueError, match="token_labels"):
        figures.temporal_heatmap(np.zeros((3, 4)), None, ["a"], "x")


def test_colours_consistent():
    assert figures.model_family("LLaDA-8B") == figures.model_family("tiny-mdm") == "mdm"
    assert figures.model_family("Llama-3-8B") == figures.model_family("Qwen2.5") == "arm"
    assert figures.model_family("Dream-7B") == "mdm"
    st = figures.series_styles(["MDM + context", "MDM no context", "ARM + context", "ARM closed-book"])
    assert st["MDM + context"]["color"] == st["MDM no context"]["color"] == figures.MDM_COLORS[0]
    assert st["ARM + context"]["color"] == st["ARM closed-book"]["color"] == figures.ARM_COLORS[0]
    assert st["MDM no context"]["linestyle"] == "--" and st["MDM + context"]["linestyle"] == "-"


# --- circuitsvis -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    model = HookedMDM.from_config(MDMConfig(d_model=32, n_layers=2, n_heads=4, d_mlp=48, d_vocab=50,
                                            mask_token_id=49))
    out = model.generate(torch.tensor([[1, 2, 3, 4]]), gen_length=4, steps=4,
                         cache="blocks.0.attn.hook_pattern" @ steps(0))
    return model, out


def test_attention_needs_cache(tiny):
    model, out = tiny
    with pytest.raises(InputError, match=re.escape('cache="blocks.0.attn.hook_pattern" @ steps(2)')):
        views.attention(out, step=2, layer=0)
    with pytest.raises(InputError, match="blocks.1.attn.hook_pattern"):
        views.attention(out, step=0, layer=1)
    bare = model.generate(torch.tensor([[1, 2, 3, 4]]), gen_length=4, steps=4)
    with pytest.raises(InputError, match="no trajectory cache"):
        views.attention(bare, step=0, layer=0)


def test_labels_keep_their_own_spaces():
    assert circuits._display(["a", "b"]) == ["a", " b"]
    assert circuits._display(["The", " cat", "[MASK]"]) == ["The", " cat", "[MASK]"]  # BPE-style: unchanged


def test_attention_view(tiny):
    model, out = tiny
    view = views.attention(out, step=0, layer=0, model=model)
    element, props = circuits.parse_view(view)
    assert element == "AttentionPatterns"
    # word-level labels (no spaces of their own) are shown space-separated; mask tokens as [MASK]
    assert props["tokens"] == ["1", " 2", " 3", " 4", " [MASK]", " [MASK]", " [MASK]", " [MASK]"]
    assert np.asarray(props["attention"]).shape == (4, 8, 8)
    sub = views.attention(out, step=0, layer=0, heads=[1, 3])
    assert np.asarray(circuits.parse_view(sub)[1]["attention"]).shape == (2, 8, 8)
    page = views.to_html(view)
    assert page.startswith("<!DOCTYPE html>") and "unpkg" not in page and "https://" not in page.split(
        "CircuitsVis.render(")[-1]
    if views.bundle_available():
        assert page.count(circuits.BUNDLE_MARKER) == 1 and "CircuitsVis.render(" in page
    fb = views.to_html(view, renderer="fallback", full_document=False)
    assert "<canvas" in fb and "CircuitsVis" not in fb and "[MASK]" in fb


def test_tokens_by_persistence_offline():
    view = views.tokens_by_persistence(["a", "b", "</script>"], [0.0, np.nan, 1.0])
    element, props = circuits.parse_view(view)
    assert element == "ColoredTokens" and props["values"] == [0.0, 0.0, 1.0]
    fb = views.to_html(view, renderer="fallback")
    assert "&lt;/script&gt;" in fb and "<script" not in fb


# --- report ------------------------------------------------------------------------------------------
def test_report_portable_offline(tmp_path, capsys, tiny):
    _, out = tiny
    src = tmp_path / "src"
    a = figures.retrieval_heatmap(np.random.rand(3, 4), "r", path=src / "retrieval.png") and src / "retrieval.png"
    b = src / "other" / "retrieval.png"  # same file name: must not collide
    figures.knockout_effect(["L0"], [0.2], [0.0], ylabel="Δ", title="k", path=b)
    folder = tmp_path / "report"
    inside = folder / "figs" / "inside.png"
    figures.temporal_heatmap(np.random.rand(3, 5), None, None, "t", path=inside)
    import pandas as pd
    view = views.attention(out, 0, 0)
    sections = [views.Section("Absorption", "MDMs absorb **less**.\n\n- one\n- two `code`", images=[(a, "caption"), b],
                              table=pd.DataFrame({"layer": [0, 1], "absorption": [0.12345, 0.5]})),
                views.Section("Views", "<p>raw <b>html</b></p>", images=[inside],
                              html=[view, views.attention(out, 0, 0, heads=[0]),
                                    views.to_html(view, renderer="fallback", full_document=False)])]
    index = views.write_report(folder, "Test report", sections, meta={"model": "tiny", "steps": 4})
    assert capsys.readouterr().out == ""
    assert index == folder / "index.html"
    text = index.read_text(encoding="utf-8")
    imgs = re.findall(r'<img src="([^"]+)"', text)
    assert len(imgs) == 3 and len(set(imgs)) == 3
    for rel in imgs:
        assert not rel.startswith(("/", "http")) and _png_ok(folder / rel)
    assert "figs/inside.png" in imgs
    assert not re.search(r"<script[^>]+src\s*=\s*[\"']?(https?:)?//", text, re.I)
    assert not re.search(r"<link[^>]+href\s*=\s*[\"']?(https?:)?//", text, re.I)
    assert "unpkg" not in text
    assert 'href="#s1-absorption"' in text and 'id="s2-views"' in text  # table of contents
    assert "<b>less</b>" in text and "<li>one</li>" in text and "<code>code</code>" in text
    assert "0.1235" in text and "<canvas" in text
    if views.bundle_available():
        assert text.count(circuits.BUNDLE_MARKER) == 1 and text.count("CircuitsVis.render(") == 2
