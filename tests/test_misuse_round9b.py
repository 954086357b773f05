"""Held-out misuse14 findings (each test fails on the behaviour the audit met): the QK split and BD3LM's absorption
null under the block-causal mask the clean forward ran, prompt_length refused where ignored, LLaDA2's steps cap
warned, the windowed knockout's unreached-step note, the every= grid of a run of unknown length."""

from __future__ import annotations

import warnings

import pytest
import torch

from mdm_lens import HookedMDM
from mdm_lens.errors import ArgumentError, SamplerConfigError


@pytest.fixture(scope="module")
def sdar(tmp_path_factory):
    from tests.families.family_checkpoints import write_sdar

    return HookedMDM.from_pretrained(str(write_sdar(tmp_path_factory.mktemp("sdar"))[0]), load_tokenizer=False)


@pytest.fixture(scope="module")
def bd3(tmp_path_factory):
    from tests.families.bd3gidd_checkpoints import BD3LM_CONFIG, write_bd3lm

    path = write_bd3lm(tmp_path_factory.mktemp("bd"), dict(BD3LM_CONFIG, model_length=32))[0]
    return HookedMDM.from_pretrained(str(path), load_tokenizer=False)


def _lead_by_hand(q, k, anchor, visible):
    """Δ per head = (1/√d) mean_{i sees j*} mean_{j visible to i, j ≠ j*} (q_i·k* − q_i·k_j), in float64."""
    T, H, d = q.shape
    group = H // k.shape[1]
    out = []
    for h in range(H):
        s = q[:, h].double() @ k[:, h // group].double().T / d ** 0.5
        rows = [torch.stack([s[i, anchor] - s[i, j] for j in range(T) if visible(i, j) and j != anchor]).mean()
                for i in range(T) if visible(i, anchor) and any(visible(i, j) for j in range(T) if j != anchor)]
        out.append(float(torch.stack(rows).mean()))
    return out


def test_qk_split_reads_the_keys_each_query_sees_under_the_block_mask(sdar):
    from mdm_lens.probes import run as R

    toks = torch.tensor([[5, 17, 33, 7, 61, 40, 9, 12, 44, 3]])
    B = sdar.cfg.extra["block_length"]
    res = R.qk_at_layer(sdar, toks, layer=1, anchor=1)
    _, c = sdar.run_with_cache(toks)
    q, k = c["blocks.1.attn.hook_rot_q"][0], c["blocks.1.attn.hook_rot_k"][0]
    want = _lead_by_hand(q, k, 1, lambda i, j: j // B <= i // B)
    everything = _lead_by_hand(q, k, 1, lambda i, j: True)
    torch.testing.assert_close(res.advantage[0].double(), torch.tensor(want, dtype=torch.float64), atol=1e-5, rtol=0)
    assert max(abs(a - b) for a, b in zip(want, everything)) > 1e-3  # the mask matters on this model
    # the pattern itself gives nothing to a key the block mask hides: the split must not average over it either
    assert float(c["blocks.1.attn.hook_pattern"][0, :, :B, B:].abs().sum()) == 0.0


def test_bd3lm_is_labelled_block_causal_and_its_absorption_null_follows_the_mask(bd3):
    from mdm_lens.probes import absorption as A

    assert bd3.cfg.attention == "block_causal" and bd3.cfg.extra["block_length"] == bd3.cfg.extra["block_size"] == 4
    assert "block-causal (block_length=4)" == bd3.cfg.attention_label
    toks = torch.randint(0, 40, (1, 12), generator=torch.Generator().manual_seed(0))
    r = A.absorption_by_layer(bd3, toks, mode="paper")
    # key 0 under blocks of 4 over 12 queries: 4 queries see 4 keys, 4 see 8, 4 see 12 → mean share of key 0
    first = 100 * (4 / 4 + 4 / 8 + 4 / 12) / 12
    assert r.block_length == 4
    torch.testing.assert_close(r.null[0, 0, 0].double(), torch.tensor(first, dtype=torch.float64), atol=1e-9, rtol=0)


@pytest.mark.parametrize("which", ["tiny", "sdar"])
def test_prompt_length_is_refused_where_no_row_split_uses_it(sdar, which):
    from mdm_lens.probes import run as R

    m = sdar if which == "sdar" else HookedMDM.from_pretrained("mdm-lens/tiny-mdm")
    toks = torch.tensor([[5, 17, 33, 7, 61, 40, 9, 12]])
    for bad in (3, 100, -1):
        with pytest.raises(ArgumentError, match="prompt_length=.* is ignored") as err:
            R.qk_at_layer(m, toks, layer=1, prompt_length=bad)
        assert err.value.argument == "prompt_length"


def test_llada2_warns_when_a_passed_steps_is_capped(tmp_path):
    from mdm_lens.diffusion.arguments import ReferenceQuirkWarning
    from mdm_lens.diffusion.generate import plan
    from tests.families.family_checkpoints import write_llada2

    m = HookedMDM.from_pretrained(str(write_llada2(tmp_path / "l2")[0]), load_tokenizer=False)
    with pytest.warns(ReferenceQuirkWarning, match=r"steps=100 is lowered to 8"):
        assert plan(m, gen_length=8, block_length=4, steps=100).n_steps == 3 * 8  # ≤ 3 blocks × the capped 8
    with pytest.warns(ReferenceQuirkWarning, match=r"steps=8 is lowered to 1 = gen_length \(8\) // minimal_topk \(5\)"):
        plan(m, gen_length=8, block_length=4, steps=8, minimal_topk=5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReferenceQuirkWarning)
        plan(m, gen_length=8, block_length=4, steps=8)   # at the cap: nothing lowered
        plan(m, gen_length=8, block_length=4)            # the default is capped silently, as documented


def test_every_grid_of_a_run_of_unknown_length_has_no_last_step(sdar):
    from mdm_lens import steps

    hooks = [("blocks.0.hook_resid_pre", lambda x, hook: None)]
    with pytest.raises(SamplerConfigError) as err:
        sdar.generate([[5, 17, 33, 7, 61, 40]], gen_length=8, fwd_hooks=hooks, hook_steps=steps(1, every=2))
    grid = str(err.value).split("grid ")[1].split("]")[0] + "]"
    values = [int(v) for v in grid.strip("[]").replace("…", "").split(",") if v.strip()]
    assert all(v % 2 == 0 for v in values), grid  # the bound is not a step every= adds on such a run


def test_a_runs_model_check_names_the_run():
    from mdm_lens import MDMConfig

    m = HookedMDM.from_pretrained("mdm-lens/tiny-mdm")
    other = HookedMDM.from_config(MDMConfig(d_model=32, n_layers=2, n_heads=4, d_mlp=64, d_vocab=64, n_ctx=64,
                                            mask_token_id=63, model_name="other"), seed=0)
    out = m.generate(torch.tensor([[5, 17, 33]]), steps=4, gen_length=4)
    with pytest.raises(Exception, match=r"out: the run was made by 'mdm-lens/tiny-mdm'.*not by the model given, "
                                        r"'other'"):
        out.replay(other, 0)
