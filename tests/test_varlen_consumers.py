"""Every consumer of a sampler run either follows a variable-length run's slots (DreamOn's expand / delete,
LLaDA2.2's InDel) or refuses it with the typed error of `require_fixed_length` / `refuse_variable_sampler`,
saying what it would do with positions that did not exist at a step. Table-driven, on real DreamOn and InDel
runs (the fixtures of tests/test_dreamon.py and tests/test_indel.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mdm_lens.errors import InputError, SamplerConfigError
from mdm_lens.hooks.reducers import ReceivedAttention
from mdm_lens.hooks.trajectory import TrajectoryCache
from tests.test_dreamon import PREFIX, SUFFIX, dreamon_model
from tests.test_indel import PROMPT, indel_model
from tests.test_indel import folder  # noqa: F401  (the LLaDA2 edit-token checkpoint fixture)

NAMES = ["blocks.0.hook_resid_post", "blocks.1.hook_resid_post", "blocks.0.attn.hook_pattern"]


@pytest.fixture(scope="module")
def dreamon_run():
    model = dreamon_model()
    out = model.generate(PREFIX, sampler="dreamon", suffix=SUFFIX, steps=40, min_gen_len=3, max_gen_len=10, seed=0,
                         record=[ReceivedAttention()], cache=TrajectoryCache(NAMES))
    assert len(set(out.trajectory.length.widths.tolist())) > 1  # the run did grow / shrink
    return model, out


def _sweep_generate(model, out):
    from mdm_lens.sweep import adapter

    model.generate = lambda *a, **k: out  # the sweep's shared run, as if its sampler had made this one
    try:
        adapter.generate(model, PREFIX, torch.ones_like(PREFIX), SimpleNamespace(gen_length=4, steps=4,
                                                                                 block_length=None), 0)
    finally:
        del model.generate


def _sae_rows(model, out):
    from mdm_lens.sae.export import _group_rows

    _group_rows(model, out, ["item"], None, "masked", "float32")


def _probe(name):
    import mdm_lens.probes as P
    from mdm_lens.probes import _runtools, ablation, attribution, patching, retrieval

    return {"anchors": lambda m, o: P.anchors_over_steps(o),
            "drift": lambda m, o: P.drift_from_output(o),
            "cache_effect": lambda m, o: P.cache_effect(m, o),
            "matched_canvases": lambda m, o: patching.matched_canvases(o, PREFIX, 0),
            "attribution_out": lambda m, o: attribution.attribution_patching(m, o, PREFIX),
            "lens_trace": lambda m, o: __import__("mdm_lens.lens.trace", fromlist=["x"]).lens_trace(m, o),
            "explore": lambda m, o: __import__("mdm_lens.views.explore", fromlist=["x"]).explore(o, m),
            "sae_export": _sae_rows,
            "sweep": _sweep_generate,
            # consumers that run generate themselves: the sampler is refused before any compute
            "knockout": lambda m, o: P.knockout(m, PREFIX, sampler="dreamon"),
            "answer_accuracy": lambda m, o: ablation.answer_accuracy(m, [], sampler="dreamon"),
            "patch_anchor": lambda m, o: patching.patch_anchor_activations(m, PREFIX, PREFIX, sampler="dreamon"),
            "retrieval": lambda m, o: retrieval.retrieval_scores(m, [], sampler="dreamon"),
            "generate_final": lambda m, o: _runtools.generate_final(m, [PREFIX[0]], sampler="indel"),
            "attribution_clean": lambda m, o: attribution.attribution_patching(m, PREFIX, PREFIX, sampler="dreamon"),
            }[name]


REFUSALS = [  # consumer, the words of what it would do
    ("anchors", "continue the series"), ("drift", "anchor persistence"), ("cache_effect", "cached keys"),
    ("matched_canvases", "patched or knocked-out"), ("attribution_out", "sum over different tokens"),
    ("lens_trace", "answer position p"), ("explore", "slider"), ("sae_export", "(item, step, position)"),
    ("sweep", "tables key every step"), ("knockout", "knocked-out key column"), ("answer_accuracy", "moved"),
    ("patch_anchor", "patched position"), ("retrieval", "copied token"), ("generate_final", "fixed-length regions"),
    ("attribution_clean", "sum over different tokens"),
]


@pytest.mark.parametrize("consumer, would", REFUSALS, ids=[c for c, _ in REFUSALS])
def test_consumers_refuse_a_variable_length_run_saying_what_they_would_do(dreamon_run, consumer, would):
    model, out = dreamon_run
    with pytest.raises(SamplerConfigError, match="did not exist at a step") as info:
        _probe(consumer)(model, out)
    assert would in str(info.value) and info.value.argument in ("out", "sampler")
    assert ("dreamon" if consumer != "generate_final" else "indel") in str(info.value)


def test_the_refusal_of_an_indel_run_names_its_constant_width(folder):  # noqa: F811
    import mdm_lens.probes as P

    model = indel_model(folder, 2.0)
    out = model.generate(PROMPT, sampler="indel", gen_length=10, max_post_edit_steps=3, record=[ReceivedAttention()])
    with pytest.raises(SamplerConfigError, match=r"'indel' run inserted and deleted rows mid-run \(canvas widths "
                                                 r"\[16\]\)"):
        P.anchors_over_steps(out)


def test_circuits_labels_are_each_steps_own_canvas(dreamon_run):
    from mdm_lens.views.circuits import step_str_tokens

    model, out = dreamon_run
    L = out.trajectory.length
    for s in range(out.n_steps):
        labels = step_str_tokens(out, s, model=model)
        w = int(L.widths[s])
        x = out.trajectory.x_steps[s, 0, :w].tolist()
        assert labels == ["[MASK]" if t == model.cfg.mask_token_id else str(t) for t in x]
    pytest.importorskip("circuitsvis")
    from mdm_lens.views.circuits import attention

    s = int(torch.argmax(L.widths))  # the widest step: its pattern and labels agree in length
    assert attention(out, s, 0, model=model) is not None


def test_linear_probe_features_stack_only_steps_with_the_same_rows(dreamon_run):
    from mdm_lens.lens.linear import features_from_cache

    model, out = dreamon_run
    with pytest.raises(InputError, match="inserted or deleted rows"):
        features_from_cache(out.cache, layers=[0, 1])


def test_router_stats_follow_each_steps_prompt_rows(folder):  # noqa: F811
    """DreamOn's loop on a MoE model (the LLaDA2 checkpoint read as shifted, with an expand id): its prompt is the
    prefix AND the suffix + EOS, wherever the span's growth put them; the router's prompt / canvas classes count
    those slots at every step (a prefix-only rule would count 5 prompt rows)."""
    from mdm_lens.probes.router import router_stats

    model = indel_model(folder, 1.0)
    model.cfg.logit_shift = True
    model.cfg.extra["expand_token_id"] = 95
    with torch.no_grad():
        model.unembed.weight[95] *= 3
        model.unembed.weight[98] *= 2
    out = model.generate(PROMPT, sampler="dreamon", suffix=[7, 30, 8], steps=20, min_gen_len=3, max_gen_len=8)
    widths = out.trajectory.length.widths.tolist()
    last = out.n_steps - 1
    assert widths[0] != widths[last]
    pos = router_stats(model, out, steps=[0, last]).table
    pos = pos[pos.metric == "positions"]
    for s in (0, last):
        got = dict(zip(pos[pos.step == s]["class"], pos[pos.step == s].value))  # the same in every MoE layer
        assert (got["prompt"], got["canvas"]) == (PROMPT.shape[1] + 3 + 1, widths[s] - PROMPT.shape[1] - 4)
