"""`model.memory_plan(...)` (mdm_lens.hooks.plan): exact per-device figures on planted settings, and a run over
budget refused before any forward."""

from __future__ import annotations

import pytest
import torch

from mdm_lens import HookedMDM, ReceivedAttention, TrajectoryCache, steps
from mdm_lens.errors import MemoryBudgetError, SamplerConfigError
from mdm_lens.hooks.plan import block_activation_bytes, head_activation_bytes

PROMPT = torch.tensor([[5, 9, 14, 30, 8, 21], [7, 7, 40, 41, 42, 43]])


@pytest.fixture(scope="module")
def tiny():
    return HookedMDM.from_pretrained("mdm-lens/tiny-mdm")


def test_single_device_figures_are_exact(tiny):
    c = tiny.cfg  # 4 layers, d_model 128, 4 heads of 32 (4 kv heads), d_mlp 384, vocab 322, fp32
    plan = tiny.memory_plan(PROMPT, steps=4, gen_length=10, kv_cache="dual", record=[ReceivedAttention()],
                            cache=TrajectoryCache(["blocks.0.hook_resid_post", "blocks.2.attn.hook_pattern"],
                                                  steps=steps(0, -1), device="cpu"))
    row = plan.rows["cpu"]
    assert list(plan.rows) == ["cpu"] and plan.positions == 16 and plan.batch == 2 and plan.steps == 4
    assert row.weights == sum(p.numel() * 4 for p in tiny.parameters())
    assert row.kv_cache == 4 * 2 * 2 * 16 * 4 * 32 * 4  # layers · (k, v) · batch · pos · kv heads · d_head · fp32
    resid, pattern = 2 * 16 * 128 * 4, 2 * 4 * 16 * 16 * 4
    records = 4 * 2 * 4 * 4 * 16 * 4  # steps · batch · layers · heads · keys · fp32
    trajectory = 4 * 2 * 16 * 8  # x_steps: the int64 canvas of each step, kept until generate returns
    assert row.caches == 2 * (resid + pattern) + records + trajectory
    # phases are never alive together: the peak is the largest; here the MLP phase (4·d + 4·d_mlp per position)
    mlp = 2 * 16 * (4 * 128 + 4 * 384) * 4
    # explicit path (hook_pattern is cached): block input, ln1 out, q (k, v are the KV cache's), scaled q, z, mask,
    # and the [b, h, T, T] scores, masked copy, fp32 softmax, cleaned softmax
    attention = 2 * 16 * (2 * 128 + 128 + 2 * 128) * 4 + 2 * 16 * 16 + 2 * 4 * 16 * 16 * 16
    head = 2 * 16 * 322 * (4 + 16)  # logits + Fast-dLLM's (dual cache) fp64 copy and fp64 softmax
    mlp += 2 * 16 * 16  # the boolean mask every block receives
    assert block_activation_bytes(c, 2, 16, 4, "explicit", kv_cache=True) == max(attention, mlp) == mlp
    assert head_activation_bytes(c, 2, 16, 4, 16) == head
    carried = 2 * 16 * 322 * 4  # the previous step's logits, referenced until the next forward returns
    assert row.activations == max(mlp + carried, head) == 262144 + 512 + carried
    assert row.streamed == 0 and row.total == row.weights + row.activations + row.kv_cache + row.caches
    assert row.budget_source.startswith("available") and plan.fits
    text = repr(plan)
    assert "weights" in text and "kv_cache" in text and "yes" in text


def test_no_kv_cache_without_the_setting_and_settings_are_checked(tiny):
    plan = tiny.memory_plan(PROMPT, steps=4, gen_length=10)
    assert plan.rows["cpu"].kv_cache == 0 and plan.notes
    assert plan.rows["cpu"].caches == 4 * 2 * 16 * 8  # only the trajectory's x_steps
    with pytest.raises(SamplerConfigError):
        tiny.memory_plan(PROMPT, steps=4, gen_length=10, kv_cache="everything")
    big = tiny.memory_plan(prompt_length=6, batch=8, steps=4, gen_length=10)
    assert big.rows["cpu"].activations > plan.rows["cpu"].activations  # batch 8 > batch 2


def test_offloaded_rows_split_weights_and_stream_the_largest_block(tmp_path, tiny):
    dm = {"embed": "cpu", "blocks.0": "cpu", "blocks.1": "disk", "blocks.2": "cpu", "blocks.3": "disk",
          "ln_final": "cpu", "unembed": "cpu"}
    off = HookedMDM.from_pretrained("mdm-lens/tiny-mdm", device_map=dm, offload_folder=tmp_path)
    plan = off.memory_plan(PROMPT, steps=4, gen_length=10, max_memory={"cpu": 10**9})
    block = sum(p.numel() * 4 for p in tiny.blocks[1].parameters())
    assert plan.rows["disk"].weights == 2 * block
    assert plan.rows["cpu"].weights + plan.rows["disk"].weights == sum(p.numel() * 4 for p in tiny.parameters())
    assert plan.rows["cpu"].streamed == block  # one disk block at a time, onto the CPU
    assert plan.rows["cpu"].budget == 10**9 and plan.rows["disk"].budget is None and plan.fits


def test_a_run_over_max_memory_is_refused_before_any_forward(tmp_path):
    dm = {"": "cpu", "blocks.3": "disk"}
    off = HookedMDM.from_pretrained("mdm-lens/tiny-mdm", device_map=dm, offload_folder=tmp_path,
                                    max_memory={"cpu": 3_000_000})
    fired = []
    with pytest.raises(MemoryBudgetError, match=r"(?s)would not fit on cpu.*NO  \(max_memory\)"):
        off.generate(PROMPT, steps=4, gen_length=10, fwd_hooks=[("hook_embed", lambda x, hook: fired.append(1))])
    assert fired == []  # refused before compute
    assert all(not hp.fwd_hooks for hp in off.hook_dict.values())
    off.max_memory = {"cpu": 10**9}  # the same run fits a larger budget
    assert off.generate(PROMPT, steps=4, gen_length=10).tokens.shape == (2, 16)


def test_fastdllm_v2_plans_the_trajectory_of_its_max_new_tokens(tmp_path):
    # Fast-dLLM v2 names the answer length max_new_tokens: the trajectory must count the answer, not the prompt
    # alone: per forward (at most one per masked position of each block, plus its AR step) over the canvas of
    # whole blocks + 1, int64 x_steps and the note's canvas (8 + 8 a position and row), the note's three bool sets
    # and the state's masked set (3 + 1), the note's int64 kv_age and the state's key-visibility row (8 + 1)
    from tests.test_fastdllm_v2 import write_fastdllm_v2

    folder, *_ = write_fastdllm_v2(tmp_path / "fd2")
    model = HookedMDM.from_pretrained(str(folder), load_tokenizer=False)
    plan = model.memory_plan(prompt_length=4, max_new_tokens=8, small_block_size=2, stop_token=5,
                             pad_id=0)
    width = (8 // 4 + 4 // 4) * 4 + 1  # blocks of bd_size 4 from the prompt's; block 1: 4 masks, block 2: 3
    assert plan.rows["cpu"].caches == (4 + 1 + 3 + 1) * (1 * width * (8 + 8 + 3 + 1) + width * (8 + 1))
