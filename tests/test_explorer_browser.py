"""The step explorer rendered in a real browser (headless Chromium): the DOM after its scripts ran is read back
and compared with the run's tensors; no console error, no network request. Skips, saying why, only where no
Chromium is installed (CI installs Debian's `chromium`)."""

from __future__ import annotations

import pytest
import torch

import mdm_lens.demo as demo
from mdm_lens import HookedMDM, MDMConfig, ReceivedAttention, steps
from mdm_lens.probes.floating import detect_anchors
from mdm_lens.views import browser, explore, step_mapping

pytestmark = pytest.mark.skipif(browser.find_chromium() is None,
                                reason="no Chromium on PATH: apt-get install chromium (CI installs it)")


def _model(attention: str, seed: int) -> HookedMDM:
    cfg = MDMConfig(d_model=32, n_layers=2, n_heads=4, d_mlp=48, d_vocab=40, n_ctx=64, attention=attention,
                    mask_token_id=39, eos_token_id=38, family="llada" if attention != "causal" else "llama")
    return HookedMDM.from_config(cfg, seed=seed, init_std=0.4, init="realistic")


@pytest.fixture(scope="module")
def runs():
    mdm, arm = _model("bidirectional", 1), _model("causal", 2)
    prompt = torch.tensor([[1, 5, 9, 12, 7, 3]])
    out = mdm.generate(prompt, steps=8, gen_length=8, block_length=4, record=[ReceivedAttention()],
                       cache="blocks.1.attn.hook_pattern" @ steps(0, 5))
    out_arm = arm.generate(prompt, gen_length=5, record=[ReceivedAttention()])
    return out, out_arm


def _tokens(page, run: int = 0):
    panel = page.dom.find_all("section", class_="mdx-run", data_run=str(run))
    assert len(panel) == 1
    return panel[0], panel[0].find_all("span", class_="mdx-tok")


def _check_step(page, out, step: int, layer: int, head: int | None, run: int = 0) -> None:
    panel, toks = _tokens(page, run)
    assert panel.attrs["data-step"] == str(step)
    cs = out.trajectory.commit_step[0]
    rec = out.records["received_attention"][step, 0, layer].double()          # [head, key]
    series = rec.mean(0) if head is None else rec[head]
    if out.causal:  # keys that do not exist yet at this step carry no value
        series = torch.where(cs[: series.shape[0]] >= step, torch.nan, series)
    anchors = detect_anchors(series, key_visible=series.isfinite(), causal=out.causal, nan_policy="omit")
    assert len(toks) == cs.shape[0]
    for pos, t in enumerate(toks):
        c = int(cs[pos])
        want = "prompt" if c < 0 else "committed" if c < step else "new" if c == step else "masked"
        assert t.attrs["data-state"] == want, pos
        shown = t.find_all("span", class_="mdx-text")[0].text_content()
        assert (shown == "[MASK]") == (want == "masked")
        v = float(series[pos])
        if v != v:
            assert "data-received" not in t.attrs
        else:
            assert float(t.attrs["data-received"]) == pytest.approx(v, rel=1e-4, abs=1e-7)
        assert t.attrs["data-anchor"] == ("1" if bool(anchors[pos]) else "0")


def _clean(page) -> None:
    assert page.loaded
    assert page.console_errors == []
    assert page.resources == []
    roots = page.dom.find_all("div", class_="mdx-root")
    assert roots and all(r.attrs.get("data-ready") == "1" and r.attrs.get("data-errors") == "0" for r in roots)


def test_slider_state_shows_that_steps_tokens_and_received_attention(tmp_path, runs):
    out, _ = runs
    path = explore(out).save(tmp_path / "explorer.html")
    for step, layer, head in ((2, 1, None), (6, 0, 3)):
        frag = f"step={step}&layer={layer}&head={'mean' if head is None else head}"
        page = browser.load(path, frag)
        _clean(page)
        _check_step(page, out, step, layer, head)
    panel, _ = _tokens(browser.load(path, "step=5&layer=1"))
    assert panel.attrs["data-pattern"] == "1"          # step 5's layer-1 pattern was cached: drawn
    panel, _ = _tokens(browser.load(path, "step=4&layer=1"))
    assert panel.attrs["data-pattern"] == "0"          # not cached at step 4


def test_two_runs_side_by_side_map_steps(tmp_path, runs):
    out, out_arm = runs
    path = explore([out, out_arm], labels=["mdm", "arm"]).save(tmp_path / "pair.html")
    page = browser.load(path, "step=7&layer=0")
    _clean(page)
    mapped = step_mapping(out.n_steps, out_arm.n_steps, 7)
    assert mapped == 4
    _check_step(page, out, 7, 0, None, run=0)
    _check_step(page, out_arm, mapped, 0, None, run=1)
    assert "step counts differ" in page.raw


def test_demo_report_embeds_a_working_explorer(tmp_path, twins):
    index = demo.run_demo(str(tmp_path / "report"), n=2)
    assert index.stat().st_size < 10 * 2**20
    page = browser.load(index, "step=2&layer=1")
    _clean(page)
    panels = page.dom.find_all("section", class_="mdx-run")
    assert len(panels) == 2 and all(p.attrs["data-step"] == "2" for p in panels)   # one linked slider
    # the values shown are each model's sweep table's
    import pandas as pd

    for panel in panels:
        label = panel.find_all("div", class_="mdx-head")[0].text_content()
        model = "arm" if "stand-in-arm" in label else "mdm"
        keys = pd.read_parquet(tmp_path / "report" / "sweeps" / f"stand-in-{model}-main" / "temporal_keys.parquet")
        item = keys["item_id"].iloc[0]
        assert f"item {item}" in label
        rows = keys[(keys.item_id == item) & (keys.layer == 1) & (keys.step == 2)].sort_values("key")
        toks = panel.find_all("span", class_="mdx-tok")
        assert len(toks) == len(rows)
        for t, (_, row) in zip(toks, rows.iterrows()):
            if row.received != row.received:
                assert "data-received" not in t.attrs
            else:
                assert float(t.attrs["data-received"]) == pytest.approx(row.received, rel=1e-4, abs=1e-7)
            assert t.attrs["data-anchor"] == ("1" if row.anchor else "0")
