"""Fast-dLLM v2 edges left open by tests/test_fastdllm_v2.py (found by a held-out mutation audit):
the sampler's defaults, refusals and boundaries (`sample_with_top_p`'s nucleus cut, `get_factor_unmask_idx`'s bars,
the forward bound, the context check), the batch bookkeeping (prefill AR token, departed rows, the exact-block
warning) and the loader's edges (bd_size, mask / pad ids, detection). Expected values follow the reference
(NikhilSDate/Fast-dLLM `v2/generation_functions.py` @ 734a60d4, its eval harness `v2/eval.py`, the modeling file's
`sample_with_top_p`), worked out by hand below each case."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from mdm_lens import HookedMDM, MDMConfig
from mdm_lens.diffusion.fastdllm_v2 import (FastDLLMv2Sampler, FastDLLMv2Settings, factor_unmask,
                                            sample_with_top_p)
from mdm_lens.errors import ConfigError, SamplerConfigError
from mdm_lens.loading import read_config
from mdm_lens.loading.fastdllm_v2 import is_fastdllm_v2
from test_fastdllm_v2 import MASK, confidence, ours, plant, planted_model, write_fastdllm_v2

STOP, PAD = 1, 0  # the planted model's stop token (its EOS) and pad id
OMIT = object()  # a setting left out of the call (its default applies)


def run(model, prompts, table, log, **kw):
    """`prompts` right-aligned (left padding, `ours`) on the planted model; `table[pos] = (token, logit)` as in
    `plant`."""
    kw = {k: v for k, v in dict(dict(block_size=4, small_block_size=4, stop_token=STOP), **kw).items()
          if v is not OMIT}
    return ours(model, prompts, fwd_hooks=plant(model, table, log), **kw)


def kinds(log):
    return [k for k, *_ in log]


# --- defaults --------------------------------------------------------------------------------------------------

def test_default_small_block_size_is_the_eval_harness_8():
    # block_size 8, threshold 0: every masked position commits at once, so each sub-block holding a mask costs one
    # forward. small_block_size 8 = one sub-block: positions 2..7 in one forward, then the AR step.
    model, log = planted_model(), []
    out = run(model, [[20, 21]], {}, log, block_size=8, small_block_size=OMIT, max_new_tokens=8, threshold=0.0)
    assert out.settings["small_block_size"] == 8 and FastDLLMv2Settings().small_block_size == 8
    assert kinds(log) == ["denoise", "ar"]
    assert out.tokens[0].tolist() == [20, 21, 3, 3, 3, 3, 3, 3, 3]


def test_default_threshold_is_batch_sample_095():
    # position 3 at p = e^6.4 / (e^6.4 + 49) = 0.9247: above 0.9, not above 0.95 -> it waits for a second forward
    model, log = planted_model(), []
    assert 0.9 < confidence(6.4) < 0.95
    out = run(model, [[20, 21]], {2: (10, 9.0), 3: (11, 6.4)}, log, threshold=OMIT, max_new_tokens=4)
    assert out.settings["threshold"] == 0.95 and FastDLLMv2Settings().threshold == 0.95
    assert kinds(log) == ["denoise", "denoise", "ar"]
    assert out.tokens[0].tolist() == [20, 21, 10, 11, 3]
    assert out.trajectory.commit_step[0].tolist() == [-1, -1, 0, 1, 2]


def big_vocab(d_vocab: int, eos: int | None):
    cfg = MDMConfig(d_model=16, n_layers=1, n_heads=2, n_kv_heads=2, d_mlp=16, d_vocab=d_vocab, mask_token_id=3,
                    attention="bidirectional", logit_shift=True, n_ctx=64, eos_token_id=eos, pad_token_id=0,
                    family="fastdllm_v2", extra={"block_length": 32})
    return HookedMDM.from_config(cfg, seed=0, init_std=0.1)


def test_default_stop_token_is_151645_when_the_vocabulary_holds_it():
    # the Qwen2.5 vocabulary: EOS <|endoftext|> 151643, the reference's FAST_DLLM_STOP_TOKEN <|im_end|> 151645
    assert FastDLLMv2Settings().resolve(big_vocab(151646, 151643)).stop_token == 151645
    assert FastDLLMv2Settings().resolve(big_vocab(151700, 151643)).stop_token == 151645
    # one id short: 151645 is not a token, the checkpoint's EOS stands in
    assert FastDLLMv2Settings().resolve(big_vocab(151645, 5)).stop_token == 5
    assert FastDLLMv2Settings(stop_token=7).resolve(big_vocab(151700, 151643)).stop_token == 7


# --- refusals --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("option,value", [("max_new_tokens", 3), ("top_p", 0.0), ("top_p", 0)])
def test_refused_settings_name_their_argument(option, value):
    # max_new_tokens < block_size: the reference's num_blocks leaves no block to decode; top_p = 0 keeps nothing
    model, log = planted_model(), []
    kw = dict(dict(max_new_tokens=8, temperature=0.5, top_p=0.9), **{option: value})
    with pytest.raises(SamplerConfigError) as info:
        run(model, [[20, 21]], {}, log, **kw)
    assert (info.value.argument, info.value.value) == (option, value) and log == []


def test_max_new_tokens_equal_to_the_block_is_accepted():
    model, log = planted_model(), []
    out = run(model, [[20, 21]], {}, log, max_new_tokens=4, threshold=0.0)
    assert out.tokens[0].tolist() == [20, 21, 3, 3, 3] and kinds(log) == ["denoise", "ar"]


def test_a_model_without_token_shift_is_refused():
    model, log = planted_model(), []
    model.cfg.logit_shift = False  # a LLaDA-style model: logit i predicts token i
    with pytest.raises(SamplerConfigError) as info:
        run(model, [[20, 21]], {}, log, max_new_tokens=4)
    assert (info.value.argument, info.value.value) == ("sampler", "fastdllm_v2") and log == []


def test_context_check_counts_the_ar_position():
    # prompt of 2 (no whole block), max_new_tokens 64: 16 blocks, the canvas holds 16 * 4 + 1 = 65 positions (the
    # last block's AR token) > n_ctx 64
    model, log = planted_model(), []
    assert model.cfg.n_ctx == 64
    with pytest.raises(SamplerConfigError) as info:
        run(model, [[20, 21]], {}, log, max_new_tokens=64)
    assert (info.value.argument, info.value.value) == ("max_new_tokens", 64) and log == []
    assert "65 positions" in str(info.value)


# --- sample_with_top_p / get_factor_unmask_idx -----------------------------------------------------------------

def test_top_p_keeps_the_token_reaching_top_p_exactly():
    # probs [0.5, 0.5], top_p 0.5: cumsum [0.5, 1.0] > 0.5 -> [F, T], shifted right -> nothing dropped
    _, probs = sample_with_top_p(torch.zeros(1, 1, 2), top_p=0.5, temperature=1.0, generator=None)
    assert torch.equal(probs, torch.tensor([[[0.5, 0.5]]]))


def test_top_p_keeps_the_token_crossing_top_p():
    # probs [0.5, 0.3, 0.2], top_p 0.6: cumsum [0.5, 0.8, 1.0] > 0.6 -> [F, T, T], shifted right -> [F, F, T]:
    # the first two kept (the second crosses 0.6), renormalised to [0.625, 0.375, 0]
    logits = torch.tensor([0.5, 0.3, 0.2]).log().view(1, 1, 3)
    _, probs = sample_with_top_p(logits, top_p=0.6, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert (probs - torch.tensor([[[0.625, 0.375, 0.0]]])).abs().max() <= 1e-6
    assert float(probs[0, 0, 2]) == 0.0


def test_factor_bar_of_the_nth_confidence_is_one_minus_factor_over_n_plus_one():
    # n = 2: bar 1 - 1/3 = 0.667 > 0.6 -> the walk stops at index 1, neither 0 nor the last: 1 position
    everything = torch.ones(1, 3, dtype=torch.bool)
    assert factor_unmask(torch.tensor([[0.9, 0.6, 0.1]]), everything, 1.0).tolist() == [[True, False, False]]
    # n = 2: 0.7 >= 0.667 passes; n = 3: bar 1 - 1/4 = 0.75 > 0.1 stops at the last index: one more -> all 3
    assert factor_unmask(torch.tensor([[0.9, 0.7, 0.1]]), everything, 1.0).tolist() == [[True, True, True]]


def test_factor_bar_is_passed_at_equality():
    # factor 1.5, n = 2: bar 1 - 1.5/3 = 0.5 exactly; 0.5 is not < 0.5, the walk goes on and stops at the last
    # index (0.1 < 1 - 1.5/4), which takes one more: all 3 positions
    everything = torch.ones(1, 3, dtype=torch.bool)
    assert 1.0 - 1.5 / 3 == float(torch.tensor(0.5))
    assert factor_unmask(torch.tensor([[0.9, 0.5, 0.1]]), everything, 1.5).tolist() == [[True, True, True]]
    assert factor_unmask(torch.tensor([[0.9, 0.49, 0.1]]), everything, 1.5).tolist() == [[True, False, False]]


# --- the forward bound ------------------------------------------------------------------------------------------

def test_bound_for_a_prompt_of_exactly_one_block():
    # a prompt of exactly block_size: no prefill (the reference prefills only past one block), decoding starts at
    # block 1; threshold 1.0 (no probability exceeds it) commits one position per forward: 4 denoising forwards and the AR one, all the bound
    model, log, bounds = planted_model(), [], []

    def bound(x, hook):
        bounds.append(model.state.n_steps)

    settings = FastDLLMv2Settings(block_size=4, small_block_size=4, max_new_tokens=4, threshold=1.0,
                                  stop_token=STOP, pad_id=PAD).resolve(model)
    assert FastDLLMv2Sampler().plan(settings, [4]).n_steps == 5
    assert FastDLLMv2Sampler().plan(settings, [5]).n_steps == 6  # a prefill, then block 1 (4 + AR)
    with pytest.warns(UserWarning, match="never reads its first block"):
        out = model.generate([20, 21, 22, 23], sampler="fastdllm_v2", block_size=4, small_block_size=4,
                             max_new_tokens=4, threshold=1.0, stop_token=STOP, pad_id=PAD,
                             fwd_hooks=plant(model, {}, log) + [("blocks.0.hook_resid_pre", bound)])
    assert kinds(log) == ["denoise"] * 4 + ["ar"] and bounds == [5] * 5
    assert out.tokens[0].tolist() == [20, 21, 22, 23, 3, 3, 3, 3, 3]
    assert out.trajectory.commit_step[0].tolist() == [-1, -1, -1, -1, 0, 1, 2, 3, 4]


# --- batches ----------------------------------------------------------------------------------------------------

def test_exact_block_warning_follows_the_shortest_prompt():
    model = planted_model()
    with pytest.warns(UserWarning, match="never reads its first block"):  # shortest prompt exactly one block
        run(model, [[20, 21, 22, 23], [20, 21, 22, 23, 24, 25, 26]], {}, [], max_new_tokens=4, threshold=0.0)
    with warnings.catch_warnings(record=True) as caught:  # only the longest is exactly one block
        warnings.simplefilter("always")
        run(model, [[20, 21, 22], [20, 21, 22, 23]], {}, [], max_new_tokens=4, threshold=0.0)
    assert not [w for w in caught if "never reads its first block" in str(w.message)]


def test_prefill_ar_token_goes_only_to_the_rows_ending_at_min_len():
    # lengths [8, 11], block 4: the prefill over positions 0..7 predicts position 8 (planted: token 12); the
    # reference writes it into `input_ids[seq_len == min_len, min_len]`: row 0 only, row 1 keeps its prompt token
    model, log = planted_model(), []
    short, long = list(range(20, 28)), list(range(30, 41))
    out = run(model, [short, long], {8: (12, 5.0)}, log, max_new_tokens=4, threshold=0.0)
    assert kinds(log)[0] == "prefill" and log[0][2:4] == (0, 8)
    assert out.tokens[0, :9].tolist() == short + [12] and out.tokens[1, :11].tolist() == long
    assert out.trajectory.commit_step[0, 8] == 0 and out.trajectory.commit_step[1, 8] == -1


def test_no_ar_step_once_every_remaining_row_has_stopped():
    # rows of 2 and 6 tokens, block 4, stop token 1 planted at positions 2 and 6. Block 0: row 0 commits 1 at 2,
    # then 3 at 3 (padded: after the stop token); row 1 still decodes, so the AR forward runs (row 0 gets the pad
    # at 4) and row 0 leaves the batch, returned width 5. Block 1: row 1 commits 1 at 6, 3 at 7 (padded); it is
    # the only row left and it has stopped: the reference breaks before the AR forward, returned width 8
    model, log = planted_model(), []
    table = {2: (STOP, 9.0), 6: (STOP, 9.0)}
    out = run(model, [[20, 21], [30, 31, 32, 33, 34, 35]], table, log, max_new_tokens=8, threshold=0.99)
    assert kinds(log) == ["denoise", "denoise", "ar", "denoise", "denoise"]
    assert out.settings["returned_lengths"] == [5, 8] and out.settings["n_forwards"] == 5
    assert out.tokens.tolist() == [[20, 21, STOP, PAD, PAD, PAD, PAD, PAD],
                                   [30, 31, 32, 33, 34, 35, STOP, PAD]]
    assert out.attention_mask.tolist() == [[1] * 5 + [0] * 3, [1] * 8]


# --- the loader -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bd_size", [0, -4, True, 4.0, "4"])
def test_bd_size_must_be_a_positive_int(tmp_path, bd_size):
    folder = write_fastdllm_v2(tmp_path / "ckpt", bd_size=bd_size)[0]
    with pytest.raises(ConfigError, match="bd_size"):
        HookedMDM.from_pretrained(str(folder), load_tokenizer=False)


def write_config(folder, vocab: int = 97, tokenizer: dict | None = None, **changes):
    """config.json (the released layout, `changes` applied; None deletes a key) and tokenizer_config.json."""
    config = {"architectures": ["Fast_dLLM_QwenForCausalLM"], "model_type": "Fast_dLLM_Qwen", "bd_size": 4,
              "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": vocab, "hidden_act": "silu", "rms_norm_eps": 1e-6,
              "rope_theta": 1e6, "max_position_embeddings": 32768, "use_sliding_window": False,
              "tie_word_embeddings": False}
    config.update(changes)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer or {}))
    return folder


def test_mask_id_from_config_json_before_the_token_name(tmp_path):
    named = {"added_tokens_decoder": {str(MASK): {"content": "|<MASK>|"}}}
    cfg, family = read_config(write_config(tmp_path / "a", tokenizer=named, mask_token_id=90), "a", None)
    assert (family, cfg.mask_token_id) == ("fastdllm_v2", 90)
    cfg, _ = read_config(write_config(tmp_path / "b", tokenizer=named), "b", None)
    assert cfg.mask_token_id == MASK


def test_mask_id_151665_only_inside_the_vocabulary(tmp_path):
    # nothing names a mask: the reference constant 151665 when it is a token id, else no mask id
    cfg, _ = read_config(write_config(tmp_path / "a", vocab=151666), "a", None)
    assert cfg.mask_token_id == 151665
    cfg, _ = read_config(write_config(tmp_path / "b", vocab=151665), "b", None)
    assert cfg.mask_token_id is None


def test_tokenizer_pad_id_only_inside_the_vocabulary(tmp_path):
    def with_pad(pad_id):
        return {"pad_token": "<|endoftext|>", "added_tokens_decoder": {str(pad_id): {"content": "<|endoftext|>"}}}

    cfg, _ = read_config(write_config(tmp_path / "a", tokenizer=with_pad(96)), "a", None)
    assert cfg.pad_token_id == 96  # the last id of a 97-token vocabulary
    cfg, _ = read_config(write_config(tmp_path / "b", tokenizer=with_pad(97)), "b", None)
    assert cfg.pad_token_id is None  # one past it


@pytest.mark.parametrize("architectures,model_type", [(["Fast_dLLM_QwenForCausalLM"], "qwen2"),
                                                      (["Fast_dLLM_QwenForCausalLM"], None),
                                                      (None, "Fast_dLLM_Qwen"),
                                                      (["Qwen2ForCausalLM"], "Fast_dLLM_Qwen")])
def test_either_the_architecture_or_the_model_type_names_the_family(tmp_path, architectures, model_type):
    folder = write_config(tmp_path / "ckpt", architectures=architectures, model_type=model_type)
    raw = json.loads((folder / "config.json").read_text())
    assert is_fastdllm_v2(raw)
    cfg, family = read_config(folder, "ckpt", None)
    assert (family, cfg.family, cfg.extra["block_length"], cfg.logit_shift) == ("fastdllm_v2", "fastdllm_v2", 4, True)


def test_plain_qwen2_is_not_fast_dllm_v2(tmp_path):
    folder = write_config(tmp_path / "ckpt", architectures=["Qwen2ForCausalLM"], model_type="qwen2")
    assert not is_fastdllm_v2(json.loads((folder / "config.json").read_text()))
    cfg, family = read_config(folder, "ckpt", None)
    assert family != "fastdllm_v2" and not cfg.logit_shift
