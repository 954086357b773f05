"""Attribution patching (AtP) over denoising steps against exact activation patching.

Exact where it must be: on a linear toy (the final norm's scale fixed by a hook, so the logits and the
logit-difference metric are linear in the last layer's mlp_out) AtP equals patching; with an ε-corruption of
the embedding the relative error shrinks ~linearly in ε (first-order method, float64); per-head estimates sum
to the attn_out one (z_h W_O[h] is the head's share of attn_out); equal inputs give zero estimates; the
gradients equal central finite differences in float64.
"""

import math

import pytest
import torch

from mdm_lens import HookedMDM, MDMConfig
from mdm_lens.errors import ArgumentError, ArgumentTypeError, InputError, OutOfRangeError
from mdm_lens.probes import attribution as AT
from mdm_lens.probes._atp_runs import StepPair, gradients, metric_tensor, run_side
from mdm_lens.probes import _causal as C

P = 10


def realistic(shift=False, dtype=torch.float32, attention="bidirectional", seed=0):
    cfg = MDMConfig(rope_full_precision=dtype != torch.float64,d_model=32, n_layers=3, n_heads=4, d_mlp=64, d_vocab=40, n_ctx=64, mask_token_id=3,
                    bos_token_id=1, eos_token_id=2, pad_token_id=0, logit_shift=shift, dtype=dtype,
                    attention=attention)
    return HookedMDM.from_config(cfg, seed=seed, init_std=0.3, init="realistic")


@pytest.fixture
def float64_norms(monkeypatch):
    """RMSNorm normalises in fp32 even in a float64 model (HF's order); finite differences and the ε → 0 limit
    need every op in float64, so the norm computes in the input's dtype here (same formula, same hooks)."""
    from mdm_lens.components import RMSNorm

    def forward(self, x):
        scale = self.hook_scale((x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())
        return self.hook_normalized(x / scale) * self.w
    monkeypatch.setattr(RMSNorm, "forward", forward)


def prompt(seed=0):
    return torch.randperm(35, generator=torch.Generator().manual_seed(seed))[:P] + 5


def corrupt(p):
    c = p.clone()
    c[2:5] = torch.tensor([6, 7, 8]) if int(p[2]) != 6 else torch.tensor([9, 10, 11])
    return c


def n_hooks(model):
    return sum(len(h.fwd_hooks) + len(h.bwd_hooks) for h in model.hook_dict.values())


def fixed_scale(scale, hook):
    # a constant RMS scale makes ln_final linear, so logits (and logit_diff) are linear in the last residual
    return torch.full_like(scale, 2.5)


@pytest.mark.parametrize("direction", ["noising", "denoising"])
@pytest.mark.parametrize("shift", [False, True])
def test_atp_equals_patching_where_the_metric_is_linear_in_the_activation(direction, shift):
    model, p = realistic(shift), prompt()
    last = model.cfg.n_layers - 1
    with model.hooks(fwd_hooks=[("ln_final.hook_scale", fixed_scale)]):
        res = AT.atp_vs_patching(model, p, corrupt(p), layers=[last], components=["mlp_out"], metric="logit_diff",
                                 direction=direction, gen_length=4)
    est, exact = res.estimates["mlp_out"][:, 0], res.exact["mlp_out"][:, 0]
    # a step that commits nothing (Dream's sampler commits two positions at step 0, none at step 1) is NaN
    done = torch.tensor([r == "" for r in res.reason])
    assert [r for r in res.reason if r] == [AT.NOTHING_COMMITTED] * int((~done).sum())
    assert torch.isnan(est[~done]).all() and torch.isnan(exact[~done]).all()
    est, exact = est[done], exact[done]
    scale = float(exact.abs().max())
    assert scale > 1e-2                                          # the corruption does move the metric
    torch.testing.assert_close(est, exact, atol=1e-5 * max(scale, 1.0), rtol=0)
    assert n_hooks(model) == 0


def test_atp_converges_to_patching_linearly_as_the_corruption_vanishes(float64_norms):
    model, p = realistic(dtype=torch.float64), prompt()
    u = torch.randn(P, model.cfg.d_model, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    out = model.generate(p, steps=4, gen_length=4)

    def rel_error(eps):  # over the whole (step, component, layer, head) grid
        def noise(x, hook):
            y = x.clone()
            y[:, :P] += eps * u
            return y
        res = AT.atp_vs_patching(model, out, [("hook_embed", noise)], steps=[0, 2], metric="logprob")
        est = torch.cat([res.estimates[c].reshape(-1) for c in res.components])
        ex = torch.cat([res.exact[c].reshape(-1) for c in res.components])
        assert res.corruption == "hooks"
        return float((est - ex).norm() / ex.norm())

    errs = [rel_error(e) for e in (1e-3, 1e-4, 1e-5)]
    # first order: the error is O(ε²) against effects O(ε), so the relative error falls ~10x per decade once ε
    # is small (measured: 0.077, 0.0099, 0.0010)
    assert errs[2] < errs[1] / 6 and errs[1] < errs[0] / 6, errs
    assert errs[2] < 3e-3


@pytest.mark.parametrize("kind", ["llada", "dream", "arm"])
def test_heads_sum_to_attn_out_and_positions_sum_to_the_layer(kind):
    model = realistic(shift=kind == "dream", attention="causal" if kind == "arm" else "bidirectional")
    p = prompt(1)
    res = AT.attribution_patching(model, p, corrupt(p), gen_length=4, per_position=True, metric="logprob")
    heads, layer = res.estimates["z"].sum(-1), res.estimates["attn_out"]
    top = float(layer.nan_to_num().abs().max())
    assert top > 1e-3
    torch.testing.assert_close(heads, layer, atol=1e-5 * top, rtol=0, equal_nan=True)
    for comp in res.components:
        for i in range(len(res.steps)):
            pos = res.per_position[comp][i]
            if res.reason[i]:                                  # nothing committed at that step (Dream's step 1)
                assert pos is None and torch.isnan(res.estimates[comp][i]).all()
                continue
            torch.testing.assert_close(pos.sum((-2, -1)), res.estimates[comp][i], atol=1e-9, rtol=1e-9)
    df = res.to_frame()
    assert {"step", "component", "layer", "head", "batch", "position", "value", "metric", "direction"} <= set(df)
    n_nan_steps = sum(bool(r) for r in res.reason)
    assert df["head"].isna().sum() == sum(len(res.per_position[c][i].reshape(-1)) for c in ("resid_pre", "attn_out",
                                          "mlp_out") for i in range(len(res.steps)) if not res.reason[i]) \
        + n_nan_steps * 3 * 3                                   # a NaN step keeps its summed rows (with the reason)


def test_equal_inputs_give_zero_estimates_and_layer0_resid_is_exactly_zero():
    model, p = realistic(), prompt(2)
    res = AT.atp_vs_patching(model, p, p.clone(), gen_length=3)
    assert torch.equal(res.estimates["resid_pre"][:, 0], torch.zeros(3, dtype=torch.float64))
    for c in res.components:
        assert float(res.estimates[c].abs().max()) < 1e-6
        assert float(res.exact[c].abs().max()) < 1e-5
    agree = res.agreement().set_index("component")
    # nothing to correlate: both figures undefined, with the reason, not 0 or 1
    assert math.isnan(agree.loc["all", "pearson"]) and "undefined" in agree.loc["all", "reason"]


@pytest.mark.parametrize("hook,index", [("blocks.1.hook_resid_pre", (0, 4, 7)), ("blocks.2.attn.hook_z", (0, None, 2, 3)),
                                        ("blocks.0.hook_mlp_out", (0, 12, 5))])
def test_gradients_equal_finite_differences_in_float64(hook, index, float64_norms):
    model, p = realistic(dtype=torch.float64), prompt(3)
    out = model.generate(p, steps=4, gen_length=4)
    pair = AT._pair(model, out, corrupt(p), 1)
    target = out.tokens[pair.committed]
    # the last layer's z reaches the metric only at the committed position's own row
    index = tuple(int(pair.committed.nonzero()[0, 1]) if i is None else i for i in index)

    def metric_of(raw):
        logits = C.readout(model, raw, pair.committed)
        return metric_tensor("logprob", logits, target, target)

    raw, acts = run_side(model, pair, "clean", [hook], grad=True)
    g = gradients(metric_of(raw), acts)[hook][index]

    def bumped(h):
        def fn(act, hook):
            act = act.clone()
            act[index] += h
            return act
        r, _ = run_side(model, pair, "clean", [], grad=False, extra=[(hook, fn)])
        return float(metric_of(r))
    h = 1e-5
    fd = (bumped(h) - bumped(-h)) / (2 * h)
    assert abs(float(g)) > 1e-4
    assert float(g) == pytest.approx(fd, rel=1e-6, abs=1e-9)
    assert n_hooks(model) == 0


def test_knockout_corruption_leaves_layer0_resid_alone_and_counts_the_heads():
    model, p = realistic(seed=4), prompt(4)
    res = AT.atp_vs_patching(model, p, "knockout", gen_length=4, steps=[0, 1])
    assert res.corruption == "knockout"
    # the knockout acts on attention scores from layer 0 on: the embedding is the same in both runs
    assert torch.equal(res.estimates["resid_pre"][:, 0], torch.zeros(2, dtype=torch.float64))
    assert float(res.estimates["attn_out"].abs().max()) > 0
    assert torch.equal(res.exact["resid_pre"][:, 0], torch.zeros(2, dtype=torch.float64))
    torch.testing.assert_close(res.estimates["z"].sum(-1), res.estimates["attn_out"], rtol=0,
                               atol=1e-5 * float(res.estimates["attn_out"].abs().max()))
    df = res.to_frame()
    assert "exact" in df and (df["corruption"] == "knockout").all()
    assert n_hooks(model) == 0


def test_denoising_mirrors_noising_at_the_clean_and_corrupted_values():
    model, p = realistic(seed=5), prompt(5)
    noise = AT.attribution_patching(model, p, corrupt(p), gen_length=4, metric="prob")
    deno = AT.attribution_patching(model, p, corrupt(p), gen_length=4, metric="prob", direction="denoising")
    assert noise.clean_value == pytest.approx(deno.clean_value, abs=1e-6)
    assert noise.corrupt_value == pytest.approx(deno.corrupt_value, abs=1e-6)
    # layer 0's resid_pre differs only at the prompt: patching all of it swaps the whole input, so the exact
    # effect is corrupt − clean (noising); AtP's two directions estimate it with opposite signs
    ex = AT.atp_vs_patching(model, p, corrupt(p), gen_length=4, metric="prob", layers=[0], components=["resid_pre"])
    diff = torch.tensor(noise.corrupt_value) - torch.tensor(noise.clean_value)
    torch.testing.assert_close(ex.exact["resid_pre"][:, 0], diff.double(), atol=1e-6, rtol=0)


def test_arguments_are_checked_and_hooks_removed_on_errors():
    model, p = realistic(), prompt()
    with pytest.raises(ArgumentError, match="components"):
        AT.attribution_patching(model, p, corrupt(p), components=["resid_post"], gen_length=3)
    with pytest.raises(ArgumentTypeError, match="components"):
        AT.attribution_patching(model, p, corrupt(p), components="z", gen_length=3)
    with pytest.raises(ArgumentError, match="direction"):
        AT.attribution_patching(model, p, corrupt(p), direction="both", gen_length=3)
    with pytest.raises(OutOfRangeError, match="steps"):
        AT.attribution_patching(model, p, corrupt(p), steps=[5], gen_length=3)
    with pytest.raises(OutOfRangeError, match="layers"):
        AT.attribution_patching(model, p, corrupt(p), layers=[3], gen_length=3)
    with pytest.raises(ArgumentError, match="corrupt"):
        AT.attribution_patching(model, p, "ablate", gen_length=3)
    with pytest.raises(ArgumentError, match="corrupt"):
        AT.attribution_patching(model, p, [("no.such.hook", fixed_scale)], gen_length=3)
    with pytest.raises(ArgumentError, match="mask token"):
        AT.attribution_patching(model, p, torch.full_like(p, 3), gen_length=3)
    with pytest.raises(ArgumentTypeError, match="0-d"):
        AT.attribution_patching(model, p, corrupt(p), metric=lambda logits: 1.0, gen_length=3)

    def boom(logits):
        raise RuntimeError("metric failed")
    with pytest.raises(RuntimeError, match="metric failed"):
        AT.attribution_patching(model, p, "knockout", metric=boom, gen_length=3)
    assert n_hooks(model) == 0
    cached = model.generate(p, steps=4, gen_length=4, block_length=2, kv_cache="prefix")
    with pytest.raises(InputError, match="kv_cache"):
        AT.attribution_patching(model, cached, corrupt(p))
    with pytest.raises(InputError, match="agreement"):
        AT.attribution_patching(model, p, corrupt(p), gen_length=3).agreement()


def test_runs_under_no_grad_and_inference_mode_runs():
    model, p = realistic(seed=7), prompt(7)
    ref = AT.attribution_patching(model, p, corrupt(p), gen_length=3)
    with torch.inference_mode():
        out = model.generate(p, steps=3, gen_length=3)
    with torch.no_grad():
        res = AT.attribution_patching(model, out, corrupt(p))
    for c in ref.components:
        torch.testing.assert_close(res.estimates[c], ref.estimates[c], atol=1e-6, rtol=1e-5)
    assert n_hooks(model) == 0


def test_callable_metric_and_frame_columns():
    model, p = realistic(seed=6), prompt(6)

    def top_logit(logits):
        return logits[:, 7].mean()
    res = AT.atp_vs_patching(model, p, corrupt(p), metric=top_logit, gen_length=3, components=["z", "mlp_out"])
    df = res.to_frame()
    assert set(df["metric"]) == {"top_logit"} and set(df["component"]) == {"z", "mlp_out"}
    assert len(df) == 3 * 3 * (4 + 1)                          # steps × layers × (heads + one mlp_out row)
    assert df["exact"].notna().all() and (df["reason"] == "").all()
    agree = res.agreement()
    assert list(agree["component"]) == ["z", "mlp_out", "all"] and (agree["n"] == [36, 9, 45]).all()


def test_sweep_probe_rows_schema_and_report_section(tmp_path):
    from mdm_lens import sweep
    from mdm_lens.cli import main
    from mdm_lens.sweep import schema
    from mdm_lens.zoo import jsonl

    jsonl.export(tmp_path / "items.jsonl", n=2, seed=0)
    out = tmp_path / "mdm"
    tables = sweep.run("mdm-lens/tiny-mdm", tmp_path / "items.jsonl", "atp", out, limit=1, batch_size=1)
    t = tables["atp"]
    assert schema.check({"atp": t, "atp_summary": tables["atp_summary"]}) == []
    L, H = 4, 4                                                        # the twin: 4 layers of 4 heads
    n_steps = t.step.nunique()
    assert len(t) == n_steps * (3 * L + L * H) and set(t.metric) == {"atp"}
    assert t["exact"].notna().all() and (t["reason"] == "").all()      # a small grid: exact ran beside AtP
    z = t[t.component == "z"].groupby(["step", "layer"])["value"].sum()
    attn = t[t.component == "attn_out"].set_index(["step", "layer"])["value"]
    assert (z - attn.reindex(z.index)).abs().max() <= 1e-5 * max(attn.abs().max(), 1e-3)
    main(["report", str(out)])
    html = (out / "report" / "index.html").read_text(encoding="utf-8")
    assert "Attribution patching over denoising steps" in html
    assert (out / "report" / "figures" / "atp_vs_exact.png").exists()


@pytest.mark.parametrize("family", ["llada2", "sdar"])
def test_block_runs_use_the_runs_block_length_linear_toy_and_head_sum(family, tmp_path):
    """Block samplers: the step forward is the run's (its canvas extent and block length, not the checkpoint's
    default 32 / 4), so on the linear toy AtP still equals patching, and the heads still sum to attn_out."""
    import sys
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[1] / "families"))
    from family_checkpoints import write_llada2, write_sdar

    runs = {"llada2": (write_llada2, dict(sampler="llada2", block_length=4, threshold=0.5)),
            "sdar": (write_sdar, dict(sampler="sdar", block_length=8, temperature=0.7, seed=3))}
    write, kw = runs[family]
    model = HookedMDM.from_pretrained(write(tmp_path / family)[0])
    p = torch.randint(0, 90, (1, 6), generator=torch.Generator().manual_seed(0))
    c = p.clone()
    c[0, 1:4] = torch.tensor([5, 6, 7])
    out = model.generate(p, gen_length=9, steps=2, **kw)
    last = model.cfg.n_layers - 1
    with model.hooks(fwd_hooks=[("ln_final.hook_scale", fixed_scale)]):
        res = AT.atp_vs_patching(model, out, c, layers=[last], components=["mlp_out"], metric="logit_diff")
    done = torch.tensor([r == "" for r in res.reason])
    est, exact = res.estimates["mlp_out"][done], res.exact["mlp_out"][done]
    scale = float(exact.abs().max())
    assert scale > 1e-2
    torch.testing.assert_close(est, exact, atol=1e-5 * max(scale, 1.0), rtol=0)
    full = AT.attribution_patching(model, out, c)
    top = float(full.estimates["attn_out"].nan_to_num().abs().max())
    torch.testing.assert_close(full.estimates["z"].sum(-1), full.estimates["attn_out"], atol=1e-5 * top, rtol=0,
                               equal_nan=True)
    assert n_hooks(model) == 0
