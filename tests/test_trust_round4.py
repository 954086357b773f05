"""Issue #32, round four: the leftovers of round three, each fixed as a class and pinned by exact checks.

* `cache.logit_attrs` names a stack / tokens shape mismatch (TL lets broadcasting fail with a bare RuntimeError).
* Dream's `eps` and `alg_temp` are inert under Fast-dLLM's threshold / factor rules, so they are refused there.
* Knockout's random control with `n_random=R` is the mean of R single draws with seeds seed, seed+1, ...: the
  draws are independent (the same seed R times would average one draw with itself), on LLaDA and DiffusionGemma.
"""

from __future__ import annotations

import pytest
import torch

from mdm_lens import HookedMDM, MDMConfig
from mdm_lens.errors import ArgumentError, SamplerConfigError
from mdm_lens.probes import patching


@pytest.fixture(scope="module")
def twin():
    return HookedMDM.from_pretrained("mdm-lens/tiny-mdm")


@pytest.fixture(scope="module")
def cached(twin):
    toks = torch.randint(0, twin.cfg.d_vocab - 2, (2, 6), generator=torch.Generator().manual_seed(0))
    _, cache = twin.run_with_cache(toks)
    return toks, cache


def test_logit_attrs_sum_to_the_logits_and_name_shape_mismatches(twin, cached):
    toks, cache = cached
    stack = cache.decompose_resid()
    attrs = cache.logit_attrs(stack, toks)
    logits = twin(toks)
    picked = logits.gather(-1, toks[..., None])[..., 0]
    # the components of an unprocessed model sum to the logit up to the unembedding bias (zero here) and the
    # final norm's own bias; check the identity on the twin, whose attributions must add up
    bias = twin.b_U[toks] if twin.b_U is not None else 0
    assert torch.allclose(attrs.sum(0) + bias, picked, atol=1e-4)
    for bad in (torch.zeros(3, 3, dtype=torch.long), torch.zeros(5, dtype=torch.long)):
        with pytest.raises(ArgumentError, match=r"tokens of shape .* do not line up") as info:
            cache.logit_attrs(stack, bad)
        assert info.value.argument == "tokens"
    with pytest.raises(ArgumentError, match=r"residual_stack has shape .*d_model=") as info:
        cache.logit_attrs(stack[..., :5], toks)
    assert info.value.argument == "residual_stack"
    with pytest.raises(ArgumentError, match="residual_stack"):
        cache.logit_attrs(stack.long(), toks)


def _dream() -> HookedMDM:
    # Dream's facts (shifted logits, cumsum positions, pair padding mask) select its sampler
    cfg = MDMConfig(d_model=32, n_layers=1, n_heads=2, d_mlp=48, d_vocab=16, n_ctx=64, mask_token_id=15,
                    logit_shift=True, position_policy="cumsum", padding_mask="pair")
    return HookedMDM.from_config(cfg, seed=0, init_std=0.05, init="realistic")


@pytest.mark.parametrize("rule", [{"threshold": 0.9}, {"factor": 1.0}])
@pytest.mark.parametrize("inert", [{"eps": 0.01}, {"alg_temp": 0.5}])
def test_dream_schedule_options_are_refused_under_the_parallel_rules(rule, inert):
    model = _dream()
    prompt = torch.tensor([[3, 4, 5, 6]])
    with pytest.raises(SamplerConfigError, match=f"{next(iter(inert))}=.*no effect.*under") as info:
        model.generate(prompt, gen_length=8, block_length=4, kv_cache="prefix", **rule, **inert)
    assert info.value.argument == next(iter(inert))
    # the same options act (and are accepted) on the entropy path
    out = model.generate(prompt, gen_length=8, steps=4, block_length=4, kv_cache="prefix", **inert)
    assert out.tokens.shape == (1, 12)


def _random_row(res):
    return res.table().loc["random", ["answer_logprob", "answer_rank", "agreement"]].astype(float)


def _check_mean_of_draws(model, prompt, **kw):
    both = _random_row(patching.knockout(model, prompt, n_random=2, seed=5, **kw))
    one = _random_row(patching.knockout(model, prompt, n_random=1, seed=5, **kw))
    two = _random_row(patching.knockout(model, prompt, n_random=1, seed=6, **kw))
    assert not one.equals(two)  # the planted case: two seeds give different draws
    assert torch.allclose(torch.tensor(both.values), (torch.tensor(one.values) + torch.tensor(two.values)) / 2,
                          atol=1e-9)


def test_random_control_draws_are_independent_on_llada(twin):
    prompt = torch.randint(5, twin.cfg.d_vocab - 2, (1, 12), generator=torch.Generator().manual_seed(1))
    _check_mean_of_draws(twin, prompt, targets=[1, 2, 3], queries="all", gen_length=8, n_steps=4)


def test_random_control_draws_are_independent_on_diffusion_gemma():
    from mdm_lens.bridge import TransformersBridge
    from mdm_lens.bridge.tiny import tiny_diffusion_gemma

    bridge = TransformersBridge(tiny_diffusion_gemma(seed=0, vocab_size=322, sliding_window=16))
    prompt = torch.randint(2, 300, (1, 10), generator=torch.Generator().manual_seed(3))
    _check_mean_of_draws(bridge, prompt, targets=[1, 2, 3], queries="all", gen_length=8, n_steps=4)


def test_a_hash_comment_inside_a_code_fence_is_not_a_heading():
    from mdm_lens.views.report import markdown_lite

    html = markdown_lite("## First\n\n```\n# a comment\n```\n\n## Second")
    assert [t[:4] for t in html.split("\n") if t.startswith("<h")] == ["<h3>", "<h3>"]
    assert "# a comment" in html                        # still shown, as code
    # a fence left open to the end hides the rest from the outline, as the renderer does
    assert [t[:4] for t in markdown_lite("## a\n\n```\n# x\n## y").split("\n") if t.startswith("<h")] == ["<h3>"]


def test_summaries_average_finite_values_and_count_inf_as_excluded():
    import math

    import pandas as pd

    from mdm_lens.sweep.summary import mean_std
    from mdm_lens.views.stats import per_item

    df = pd.DataFrame({"g": ["a"] * 4 + ["b"], "value": [1.0, 3.0, float("inf"), float("nan"), float("-inf")],
                       "item_id": [0, 0, 1, 2, 3]})
    out = mean_std(df, ["g"]).set_index("g")
    assert out.loc["a", "mean"] == 2.0 and out.loc["a", "std"] == 1.0
    assert out.loc["a", "n"] == 2 and out.loc["a", "n_excluded"] == 2
    assert math.isnan(out.loc["b", "mean"]) and out.loc["b", "n"] == 0 and out.loc["b", "n_excluded"] == 1
    df2 = pd.DataFrame({"item_id": [0, 0, 1], "value": [1.0, float("inf"), 4.0]})
    assert per_item(df2).tolist() == [1.0, 4.0]         # the inf row is skipped, not the whole item


# --- config facts the fresh blind list found untested (loaders) ---------------------------------------------------

def _families_dir():
    import sys
    from pathlib import Path

    here = str(Path(__file__).parent / "families")
    if here not in sys.path:
        sys.path.insert(0, here)


@pytest.mark.parametrize("key", ["pad_token_id", "bos_token_id"])
@pytest.mark.parametrize("writer", ["write_llada2", "write_lladamoe"])
def test_list_valued_pad_and_bos_ids_are_refused_naming_the_key(tmp_path, writer, key):
    """Only eos_token_id may be a list (transformers' generation config); a list pad/bos id is refused at load
    rather than guessed (first or last entry)."""
    _families_dir()
    import family_checkpoints as fc
    from mdm_lens.errors import ConfigError
    from mdm_lens.loading.family_parts import in_vocab

    folder = getattr(fc, writer)(tmp_path / "m", **{key: [97, 96]})[0]
    with pytest.raises(ConfigError, match=rf"{key}=\[97, 96\] is invalid"):
        HookedMDM.from_pretrained(str(folder), load_tokenizer=False)
    with pytest.raises(ConfigError, match="not the list"):
        in_vocab([97, 96], 101)
    assert in_vocab(97, 101) == 97 and in_vocab(126081, 101) is None and in_vocab(True, 101) is None


def test_llada2_shared_expert_width_is_num_shared_times_the_expert_width(tmp_path):
    """LLaDA2's shared expert is one MLP of width moe_intermediate_size × num_shared_experts (2 here, not the
    fixture's 1, so a loader that drops the count fails to load the hub tensors or differs from the reference)."""
    _families_dir()
    from family_checkpoints import block_additive_mask, write_llada2
    from family_reference import llada2_forward

    folder, config, sd = write_llada2(tmp_path / "m", num_shared_experts=2)
    model = HookedMDM.from_pretrained(str(folder), load_tokenizer=False)
    assert model.cfg.extra["moe"]["d_shared"] == 2 * config["moe_intermediate_size"]
    tokens = torch.randint(0, 100, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = model(tokens, block_length=4)
    assert (got - llada2_forward(sd, config, tokens, block_additive_mask(9, 4))).abs().max() <= 1e-4


@pytest.mark.parametrize("family,d_head", [("sdar", 128), ("sdar_moe", 16)])
def test_sdar_head_dim_absent_takes_the_reference_class_default(tmp_path, family, d_head):
    """SDARConfig's head_dim defaults to 128 whatever hidden_size says; Qwen3MoeConfig's (SDAR-MoE) to
    hidden_size // heads. A tiny config without head_dim tells them apart (64 // 4 = 16)."""
    from mdm_lens.loading.sdar import config_from_sdar

    config = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, mask_token_id=100, moe_intermediate_size=24, num_experts=4,
                  num_experts_per_tok=2)
    assert config_from_sdar(config, family, "tiny", tmp_path).d_head == d_head
    assert config_from_sdar({**config, "head_dim": 24}, family, "tiny", tmp_path).d_head == 24


def _small(**kw) -> HookedMDM:
    cfg = MDMConfig(d_model=32, n_layers=2, n_heads=4, d_mlp=48, d_vocab=50, n_ctx=32, mask_token_id=49, **kw)
    return HookedMDM.from_config(cfg, seed=3, init_std=0.05, init="realistic")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_checkpoint_with_one_non_finite_entry_is_refused_naming_the_tensor(tmp_path, bad):
    from safetensors.torch import load_file, save_file

    from mdm_lens.errors import CheckpointError
    from mdm_lens.loading import save_pretrained

    save_pretrained(_small(), tmp_path)
    shard = next(tmp_path.glob("*.safetensors"))
    sd = load_file(str(shard))
    name = next(k for k, v in sd.items() if v.ndim == 2)
    sd[name][1, 2] = bad  # one entry of many: a guard that needs *every* entry bad misses it
    save_file(sd, str(shard), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{name}.*NaN or inf"):
        HookedMDM.from_pretrained(str(tmp_path), load_tokenizer=False)


def test_absorption_is_exact_on_planted_mass_and_nan_without_mass():
    from mdm_lens.probes.received import absorption

    received = torch.tensor([[0.5, 1.5, 2.0, 0.0], [0.0, 0.0, 0.0, 0.0], [0.0, 3.0, 0.0, 1.0]], dtype=torch.float64)
    anchors = torch.tensor([[True, False, True, False], [True, True, False, False], [False, False, True, True]])
    got = absorption(received, anchors)
    assert got[0].item() == 100.0 * 2.5 / 4.0 and got[2].item() == 25.0
    assert torch.isnan(got[1])  # no mass at all: the share is undefined, not 0


def test_unpaired_difference_is_mean_a_minus_mean_b():
    """Two samples with different item ids: the estimate is mean(a) − mean(b) exactly, with each size reported
    (a sum, or the paired path, would give other numbers here)."""
    import pandas as pd

    from mdm_lens.views.stats import difference

    a = pd.Series([1.0, 2.0, 3.0], index=["x", "y", "z"])
    b = pd.Series([10.0, 30.0], index=["u", "v"])
    iv = difference(a, b, n_boot=200, seed=0)
    assert iv.estimate == pytest.approx(2.0 - 20.0) and (iv.n, iv.n_other) == (3, 2)
    assert iv.low <= -18.0 <= iv.high and iv.high < 0


class _FlowSweep:
    """What flow_section reads of a sweep: a label and its flow table (item-level rows only: region NaN)."""

    def __init__(self, label, ratios):
        import numpy as np
        import pandas as pd

        rows = []
        for i, r in enumerate(ratios):
            for metric, v in (("gold_ratio_density", r), ("row_spread", 0.1), ("bos_share", 0.2)):
                rows.append(dict(item_id=f"i{i}", metric=metric, value=v, region=np.nan, kind=np.nan, gold_index=0))
        self.label, self._t = label, pd.DataFrame(rows)

    def table(self, name):
        return self._t if name == "flow" else None


@pytest.mark.parametrize("ratios,says", [([0.5, 0.6, 0.55, 0.65, 0.58, 0.62], "less flow"),
                                         ([1.5, 1.6, 1.55, 1.65, 1.58, 1.62], "more density-normalised")])
def test_flow_finding_tests_the_gold_ratio_against_one(tmp_path, ratios, says):
    """Gold ratio 1 = no preference: ratios all below 1 (yet positive) must read "less flow", never "more"."""
    from mdm_lens.views.sweep_sections import flow_section

    section = flow_section([_FlowSweep("m", ratios)], tmp_path)
    assert says in section.finding
    assert ("more density-normalised" in section.finding) == (says != "less flow")
