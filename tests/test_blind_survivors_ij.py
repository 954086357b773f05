"""Blind mutation lists I and J (audit/2026-12-05): what survived the suite, each pinned by a planted case whose
expected value comes from the reference (the spec's class defaults, transformers' list rule), not from our code."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mdm_lens import HookedMDM
from mdm_lens.ddit.hub import bd3lm_config, gidd_config
from mdm_lens.ddit.loading import config_from_ddit
from mdm_lens.loading.hf import config_from_hf

# the hub config classes' defaults (families-2.md §2.2 MDLMConfig, §3 BD3LMConfig, §4.1 Duo, §5 DITConfig): a
# config.json without the key gets the CLASS default (MDLM / BD3LM cond_dim 129, though released files say 128)
CLASS_DEFAULTS = {
    "mdlm": dict(d_vocab=50258, n_ctx=1024, d_model=768, n_layers=12, n_heads=12,
                 extra=dict(cond_dim=129, dropout=0.1, time_conditioning=False)),
    "duo": dict(d_vocab=50258, n_ctx=1024, d_model=768, n_layers=12, n_heads=12, extra=dict(cond_dim=128, dropout=0.1)),
    "bd3lm": dict(d_vocab=50258, n_ctx=1024, d_model=768, n_layers=12, n_heads=12,
                  extra=dict(cond_dim=129, dropout=0.1, time_conditioning=False, block_size=1, attn_backend="flex",
                             var_min=True, sampling_eps_min=1e-3, sampling_eps_max=0.999)),
    "gidd": dict(d_vocab=50258, n_ctx=1024, d_model=768, n_layers=12, n_heads=12,
                 extra=dict(cond_dim=128, dropout=0.0, p_uniform=0.0, t_eps=1e-4)),
}


def _config(family: str, raw: dict):
    where = Path("config.json")
    if family == "bd3lm":
        return bd3lm_config(raw, "x", where)
    if family == "gidd":
        return gidd_config(raw, "x", where)
    return config_from_ddit(raw, family, "x", where)


@pytest.mark.parametrize("family", CLASS_DEFAULTS)
def test_a_config_without_keys_gets_the_reference_class_defaults(family):
    cfg, want = _config(family, {}), CLASS_DEFAULTS[family]
    for key, value in want.items():
        if key != "extra":
            assert getattr(cfg, key) == value, key
    for key, value in want["extra"].items():
        assert cfg.extra[key] == pytest.approx(value) if isinstance(value, float) else cfg.extra[key] == value, key


@pytest.mark.parametrize("family", ["llama", "qwen2", "dream"])
def test_list_valued_special_ids_take_the_first_entry(family):
    # transformers reads a list-valued bos/pad id by its first entry (generation's `eos_token_id[0]` rule)
    raw = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, intermediate_size=64,
               vocab_size=100, max_position_embeddings=64, rms_norm_eps=1e-5, bos_token_id=[5, 7],
               pad_token_id=[3, 9])
    cfg = config_from_hf(raw, family, "x")
    assert (cfg.bos_token_id, cfg.pad_token_id) == (5, 3)


def test_an_explicit_gen_length_beats_the_checkpoints(monkeypatch):
    import mdm_lens.zoo.evaluate as E
    from types import SimpleNamespace

    model = HookedMDM.from_pretrained("mdm-lens/tiny-mdm")
    assert model.cfg.extra["gen_length"] == 4
    seen, real = [], E.greedy_mdm_canvas
    monkeypatch.setattr(E, "greedy_mdm_canvas", lambda m, prompts, g: seen.append(g) or real(m, prompts, g))
    item = SimpleNamespace(prompt="the capital of france is")  # the evaluator reads only the prompt
    E.greedy_answer(model, [item], gen_length=2)
    E.greedy_answer(model, [item])
    assert seen == [2, 4]  # the argument when given, the checkpoint's otherwise


def test_arm_answer_rows_include_the_row_that_emits_the_first_answer_token():
    from mdm_lens.probes._causal import readout_rows

    arm = HookedMDM.from_pretrained("mdm-lens/tiny-arm")
    rows = readout_rows(arm, torch.zeros(2, 6, dtype=torch.long), 3, "answer")
    assert rows.tolist() == [[False, False, True, True, True, True]] * 2
    assert readout_rows(arm, torch.zeros(1, 6, dtype=torch.long), 3, "masked").tolist() == [[False] * 5 + [True]]


def test_a_setting_the_checkpoint_lacks_is_not_called_a_conflict(tmp_path):
    from mdm_lens.errors import SamplerConfigError
    from tests.test_fastdllm_v2 import write_fastdllm_v2

    folder, *_ = write_fastdllm_v2(tmp_path / "fd2")
    model = HookedMDM.from_pretrained(str(folder), load_tokenizer=False)
    assert model.cfg.pad_token_id is None
    with pytest.raises(SamplerConfigError, match="pass pad_id=") as err:
        model.memory_plan(prompt_length=4, max_new_tokens=8, small_block_size=2, stop_token=5)
    assert "conflicts" not in str(err.value) and err.value.argument == "pad_id"


def test_verdicts_follow_the_interval_not_the_point_estimate():
    from mdm_lens.views.stats import Interval

    assert Interval(-0.1, -0.5, 0.3, 5).verdict == "tie"  # below 0, but the interval holds 0
    assert Interval(0.1, -0.3, 0.5, 5).verdict == "tie"
    assert Interval(-0.2, -0.5, -0.1, 5).verdict == "negative"
    assert Interval(0.2, 0.1, 0.3, 5).verdict == "positive"
    assert Interval(float("nan"), float("nan"), float("nan"), 0).verdict == "undefined"


def test_a_95_percent_interval_leaves_2_5_percent_of_the_bootstrap_in_each_tail():
    import numpy as np

    from mdm_lens.views.stats import _boot_means, bootstrap_mean

    values = np.random.default_rng(0).normal(size=40)
    iv = bootstrap_mean(values, n_boot=20000, seed=3, level=0.95)
    boots = _boot_means([values], 20000, 3)  # the same resamples the interval was read from
    assert abs(float((boots < iv.low).mean()) - 0.025) < 0.002
    assert abs(float((boots > iv.high).mean()) - 0.025) < 0.002


def test_sweep_summaries_report_the_population_std():
    import pandas as pd

    from mdm_lens.sweep.summary import mean_std

    df = pd.DataFrame({"g": ["a"] * 4 + ["b"], "value": [1.0, 2.0, 3.0, 4.0, 7.0]})
    out = mean_std(df, ["g"]).set_index("g")
    assert out.loc["a", "std"] == pytest.approx(1.25 ** 0.5)  # ddof=0: sqrt(mean squared deviation)
    assert out.loc["b", "std"] == 0.0  # one item: 0 spread, not NaN
    assert out.loc["a", "mean"] == 2.5 and out.loc["a", "n"] == 4


def test_every_k_always_includes_the_last_step():
    from mdm_lens import steps

    sel = steps(every=3)
    assert [k for k in range(8) if sel.matches(k, 8)] == [0, 3, 6, 7]
    assert [k for k in range(7) if sel.matches(k, 7)] == [0, 3, 6]


def test_a_causal_suffix_of_queries_sees_keys_up_to_its_own_position():
    from mdm_lens.probes.received import visibility_mask

    # 2 queries at positions 2, 3 of 4 keys (a KV-cached suffix): query 0 sees keys 0..2, query 1 all four
    assert visibility_mask(2, 4, causal=True).tolist() == [[True, True, True, False], [True, True, True, True]]
    assert visibility_mask(4, 4, block_length=2).tolist() == [
        [True, True, False, False], [True, True, False, False], [True] * 4, [True] * 4]


def test_omit_drops_non_finite_keys_from_anchor_detection():
    from mdm_lens.probes.floating import detect_anchors

    received = torch.tensor([[0.60, float("nan"), 0.15, 0.05, 0.05, 0.05, 0.05, 0.05]])
    got = detect_anchors(received, rule="topk", k=2, nan_policy="omit")
    assert got.tolist() == [[True, False, True, False, False, False, False, False]]  # NaN is never an anchor
    with pytest.raises(Exception, match="received"):
        detect_anchors(received, rule="topk", k=2)  # the default policy refuses a NaN visible key


def test_dream_padded_rows_count_positions_from_their_first_real_token():
    from mdm_lens.config import MDMConfig

    cfg = MDMConfig(d_model=16, n_layers=1, n_heads=2, d_head=8, d_mlp=32, d_vocab=40, n_ctx=16,
                    position_policy="cumsum", padding_mask="pair", logit_shift=True, family="dream")
    model = HookedMDM.from_config(cfg, seed=0)
    am = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1]])
    pos = model.positions(torch.ones(3, 5, dtype=torch.long), am)
    # the reference: cumsum(mask) - 1, pads set to 1
    assert pos.tolist() == [[1, 1, 0, 1, 2], [0, 1, 2, 3, 4], [1, 0, 1, 2, 3]]


def test_checkpoint_special_ids_beat_the_family_constants():
    from mdm_lens.config import MDMConfig
    from mdm_lens.loading import _apply_registry_facts

    cfg = MDMConfig(d_model=16, n_layers=1, n_heads=2, d_head=8, d_mlp=32, d_vocab=200000, n_ctx=16, family="dream",
                    mask_token_id=7, pad_token_id=9)
    _apply_registry_facts(cfg, None, "dream")
    assert (cfg.mask_token_id, cfg.pad_token_id) == (7, 9)  # config.json's own ids
    bare = MDMConfig(d_model=16, n_layers=1, n_heads=2, d_head=8, d_mlp=32, d_vocab=200000, n_ctx=16, family="dream")
    _apply_registry_facts(bare, None, "dream")
    assert (bare.mask_token_id, bare.pad_token_id) == (151666, 151643)  # absent: the reference constants


def test_a_device_map_entry_claims_its_module_not_others_sharing_the_prefix():
    from mdm_lens.loading.placement import target_of

    dm = {"": "cpu", "blocks.1": "disk", "blocks.1.mlp": 0}
    assert target_of("blocks.1.attn.W_Q", dm) == "disk"
    assert target_of("blocks.1.mlp.W_in", dm) == 0
    assert target_of("blocks.10.attn.W_Q", dm) == "cpu"  # blocks.10 is not inside blocks.1
    assert target_of("blocks.1", dm) == "disk"
    assert target_of("blocks.1.mlpx", dm) == "disk"
