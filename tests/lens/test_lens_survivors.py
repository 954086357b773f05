"""Planted cases and hand computations for behaviours a held-out mutation audit found untested: the lens cache
must cover every requested step, never-committed positions, the KL direction and its token-weighted mean, the
tuned-lens loss per layer, the linear probes' item bootstrap / standardisation / stratified split / mean pooling /
logit threshold, and the sweep's lens table and report section."""

from types import SimpleNamespace

import pandas as pd
import pytest
import torch

from mdm_lens import steps as at_steps
from mdm_lens.errors import InputError
from mdm_lens.lens import LensTrace, answer_emergence, lens_trace, masked_kl, train_tuned_lens
from mdm_lens.lens.linear import ProbeFeatures, features_from_cache, fit_logistic, fit_ridge, probe_grid
from mdm_lens.lens.logit import resid_name
from mdm_lens.sae.canvas import MaskedCanvas

from ._lensfix import GEN, dream_model, twin_prompts


# --- planted LensTraces -------------------------------------------------------------------------------
def _trace(correct, commit, *, final_prob=None, masked=None):
    """A LensTrace with the given `correct` [step, layer, batch, pos] and `commit_step` [batch, pos]."""
    S, L, B, P = correct.shape
    final = torch.full((B, P), 7)
    top1 = torch.where(correct, final[None, None], final[None, None] + 1)
    prob = torch.full(correct.shape, 0.5) if final_prob is None else final_prob
    masked = torch.ones(S, B, P, dtype=torch.bool) if masked is None else masked
    return LensTrace("logit", list(range(S)), list(range(L)), list(range(P)), S, 0, top1, prob, prob,
                     (~correct).long(), final, commit, masked)


def test_lens_cache_missing_a_step_is_replayed_or_refused(mdm):
    ids, am = twin_prompts(mdm)
    out = mdm.generate(ids, attention_mask=am, gen_length=GEN, steps=GEN, seed=0,
                       cache="blocks.*.hook_resid_post" @ at_steps(0, 2))
    assert sorted(out.cache.steps) == [0, 2]
    auto = lens_trace(mdm, out)                      # all 8 steps requested, 2 cached: must replay
    assert auto.source == "replay" and auto.steps == list(range(GEN))
    with pytest.raises(InputError, match="lacks some of the requested steps"):
        lens_trace(mdm, out, source="cache")
    part = lens_trace(mdm, out, steps=[0, 2])        # covered: read from the cache, equal to the replay
    assert part.source == "cache" and torch.equal(part.top1, auto.top1[[0, 2]])


def test_never_committed_positions_are_judged_up_to_the_last_step():
    # one layer, one row, three positions over steps 0..3; positions 0 and 1 never committed (-1)
    c = torch.tensor([[1, 0, 1], [1, 0, 1], [1, 1, 0], [1, 1, 0]], dtype=torch.bool)[:, None, None]
    trace = _trace(c, torch.tensor([[-1, -1, 1]]))
    df = answer_emergence(trace).set_index("position")
    assert df.emergence_step.tolist() == [0, 2, 0]
    assert df.commit_step.isna().tolist() == [True, True, False] and df.lead.isna().tolist() == [True, True, False]
    assert df.lead[2] == 1 and df.note.isna().all()


# --- the sweep's lens table and its report section ----------------------------------------------------
def test_lens_table_final_prob_is_over_masked_positions_only():
    from mdm_lens.sweep.lens_tables import _step_rows

    c = torch.ones(3, 1, 1, 3, dtype=torch.bool)
    prob = torch.tensor([0.1, 0.4, 0.7]).expand(3, 1, 1, 3).clone()
    masked = torch.tensor([[1, 1, 1], [0, 1, 1], [0, 0, 0]], dtype=torch.bool)[:, None]
    rows = _step_rows(_trace(c, torch.tensor([[0, 1, 1]]), final_prob=prob, masked=masked), ["a"])
    fp = rows[rows.metric == "final_prob_masked"].sort_values("step")
    assert fp.value.iloc[0] == pytest.approx(0.4) and fp.value.iloc[1] == pytest.approx(0.55)
    assert pd.isna(fp.value.iloc[2]) and fp.note.iloc[2] == "no position is masked at this step"


def test_lens_table_emergence_uses_the_commit_horizon():
    from mdm_lens.sweep.lens_tables import _emergence_rows

    # committed at step 1; the top-1 is the final token at steps 0, 1 and not after: emerged at 0 by the commit
    c = torch.tensor([1, 1, 0, 0], dtype=torch.bool)[:, None, None, None]
    model = SimpleNamespace(cfg=SimpleNamespace(eos_token_id=2, pad_token_id=0, extra={}))
    rows = _emergence_rows(model, _trace(c, torch.tensor([[1]])), ["a"]).set_index("metric")
    assert rows.value["emergence_step"] == 0 and rows.value["lead"] == 1 and rows.value["commit_step"] == 1


class _Sweep:
    def __init__(self, table):
        self.label, self._t = "planted", table

    def table(self, name):
        return self._t if name == "lens" else None


def test_report_counts_known_one_step_early_as_lead_at_least_one(tmp_path):
    from mdm_lens.views.fig_lens import lens_section

    base = dict(item_id="a", answer_position=pd.NA, answer=pd.NA, note=None)
    rows = [dict(base, step=s, layer=0, metric="acc_masked", value=0.5) for s in (0, 1)]
    em, lead = [3, 2, 1, None], [0, 1, 2, None]
    for p in range(4):
        pos = dict(base, step=pd.NA, layer=0, answer_position=p, answer=True)
        rows += [dict(pos, metric="emergence_step", value=em[p]), dict(pos, metric="lead", value=lead[p])]
    t = pd.DataFrame(rows)
    t["value"] = t["value"].astype(float)
    for col in ("step", "layer", "answer_position"):
        t[col] = t[col].astype("Int64")
    t["answer"] = t["answer"].astype("boolean")
    sec = lens_section([_Sweep(t)], tmp_path)
    row = sec.table.iloc[0]
    assert row["answer tokens"] == 4 and row["known ≥1 step early"] == 0.5     # leads 1 and 2, not 0 or NA
    assert row["emerged by commit"] == 0.75 and row["mean lead (steps)"] == 1.0


# --- the tuned lens' KL ---------------------------------------------------------------------------------
def _hand_kls(model, noisy, masked, layers):
    """Per layer, the list of KL(final || logit lens) of each masked position, in float64, one at a time."""
    logits, cache = model.run_with_cache(noisy, return_type="aligned",
                                         names_filter=[resid_name(l) for l in layers])
    out = {l: [] for l in layers}
    for b, i in masked.nonzero().tolist():
        logp = logits[b, i].double().log_softmax(-1)
        src = max(i - 1, 0) if model.cfg.logit_shift else i
        for l in layers:
            row = cache[resid_name(l)][b, src][None, None]
            logq = model.unembed(model.ln_final(row))[0, 0].double().log_softmax(-1)
            out[l].append(float((logp.exp() * (logp - logq)).sum()))
    return out


def _tokens(model, n=3, width=10):
    return torch.randint(5, model.cfg.d_vocab, (n, width), generator=torch.Generator().manual_seed(4))


def test_masked_kl_is_forward_kl_token_weighted_over_batches():
    model = dream_model()
    tokens = _tokens(model)
    got = masked_kl(model, tokens, mask_rate=0.5, seed=3, batch_size=2)       # batches of 2 rows and 1 row
    canvas = MaskedCanvas(model, mask_rate=0.5, positions="all", seed=3)
    per = {l: [] for l in range(3)}
    sizes = []
    for rows in (slice(0, 2), slice(2, 3)):
        noisy, masked = canvas.mask(tokens[rows])
        sizes.append(int(masked.sum()))
        with torch.no_grad():
            for l, v in _hand_kls(model, noisy, masked, range(3)).items():
                per[l].append(v)
    assert sizes[0] > 0 and sizes[1] > 0
    want = torch.tensor([sum(sum(v, [])) / sum(sizes) for v in per.values()], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    # below the output layer the two batches' means differ, so a mean of batch means would not match
    means = torch.tensor([[sum(b) / len(b) for b in v] for v in per.values()])
    assert (means[:2, 0] - means[:2, 1]).abs().min() > 1e-2 and want[2] < 1e-9   # the last layer's lens = output


def test_tuned_lens_training_loss_is_per_trained_layer():
    model = dream_model()
    tokens = _tokens(model)
    lens = train_tuned_lens(model, tokens, n_steps=1, batch_size=2, mask_rate=0.5, seed=0)
    assert lens.training_info["trained_layers"] == [0, 1]
    # step 1's loss is taken before the update, at the identity lens (= the logit lens), on the seed's draw
    rows = torch.randint(tokens.shape[0], (2,), generator=torch.Generator().manual_seed(1))
    noisy, masked = MaskedCanvas(model, mask_rate=0.5, positions="all", seed=0).mask(tokens[rows])
    with torch.no_grad():
        kls = _hand_kls(model, noisy, masked, [0, 1])
    want = sum(sum(v) / len(v) for v in kls.values()) / 2
    assert lens.training_info["loss"][0] == pytest.approx(want, rel=1e-5)


# --- linear probes ----------------------------------------------------------------------------------------
def _standardised(x, item, train, test):
    tr, te = torch.isin(item, train), torch.isin(item, test)
    xtr, xte = x[tr].double(), x[te].double()
    mean, std = xtr.mean(0), xtr.std(0, unbiased=False)
    return (xtr - mean) / std, (xte - mean) / std, tr, te


def _hand_r2_ci(pred, y, item, test_items, n_boot, seed, ci=0.95):
    """Point R² and the percentile CI of a bootstrap over test ITEMS, written out one resample at a time."""
    def r2w(w):
        mean = (w * y).sum() / w.sum()
        return float(1 - (w * (y - pred) ** 2).sum() / (w * (y - mean) ** 2).sum())

    g = torch.Generator().manual_seed(seed)
    draws = torch.randint(len(test_items), (n_boot, len(test_items)), generator=g)
    slot = torch.searchsorted(test_items, item)
    boot = torch.tensor([r2w(torch.bincount(d, minlength=len(test_items)).double()[slot]) for d in draws],
                        dtype=torch.float64)
    q = torch.quantile(boot, torch.tensor([(1 - ci) / 2, (1 + ci) / 2], dtype=torch.float64))
    return r2w(torch.ones_like(y)), float(q[0]), float(q[1])


def _ridge_case(per_position):
    g = torch.Generator().manual_seed(11)
    n_items, pos, d = 16, 3, 3
    shape = (1, 1, n_items, pos, d) if per_position else (1, 1, n_items, d)
    acts = torch.randn(shape, generator=g, dtype=torch.float64) + 2.0
    w = torch.tensor([1.0, -0.5, 0.25], dtype=torch.float64)
    y = acts[0, 0] @ w + 0.5 * torch.randn(shape[2:-1], generator=g, dtype=torch.float64)
    return acts, y


@pytest.mark.parametrize("per_position", [True, False])
def test_ridge_r2_and_ci_equal_a_hand_item_bootstrap(per_position):
    acts, y = _ridge_case(per_position)
    feats = ProbeFeatures(acts, [0], [0])
    t = probe_grid(feats, y, probe="ridge", alpha=1.0, n_boot=200, seed=4, test_fraction=0.5)
    train, test = torch.tensor(t.attrs["train_items"]), torch.tensor(t.attrs["test_items"])
    n_items = acts.shape[2]
    x = acts[0, 0].reshape(-1, acts.shape[-1])
    item = torch.arange(n_items).repeat_interleave(acts.shape[3] if per_position else 1)
    yy = y.reshape(-1)
    xtr, xte, tr, te = _standardised(x, item, train, test)      # the TRAIN mean and std for both
    wr, b = fit_ridge(xtr, yy[tr], alpha=1.0)
    value, lo, hi = _hand_r2_ci(xte @ wr + b, yy[te], item[te], test, 200, 4)
    row = t.iloc[0]
    assert row.metric == "r2" and row.n_test == len(test) == 8
    assert row.value == pytest.approx(value, abs=1e-9)
    assert (row.ci_low, row.ci_high) == pytest.approx((lo, hi), abs=1e-9)
    if per_position:  # resampling rows (each its own "item") gives another, narrower interval here
        rows_lo, rows_hi = _hand_r2_ci(xte @ wr + b, yy[te], torch.arange(int(te.sum())),
                                       torch.arange(int(te.sum())), 200, 4)[1:]
        assert abs((rows_hi - rows_lo) - (hi - lo)) > 1e-3


def test_item_level_logistic_split_is_stratified():
    g = torch.Generator().manual_seed(0)
    labels = torch.tensor([0, 0, 1, 0, 0, 0, 1, 0])       # two items of the rare class
    acts = torch.randn(1, 1, 8, 2, generator=g) + labels[:, None] * 2.0
    for seed in range(6):
        t = probe_grid(ProbeFeatures(acts[None, 0], [0], [0]), labels, n_boot=0, seed=seed)
        test = t.attrs["test_items"]
        assert sorted(set(labels[test].tolist())) == [0, 1], (seed, test)   # both classes held out
        assert t.set_index("metric").value.notna().all()


class _FakeCache:
    def __init__(self, acts):
        self.acts, self.names, self.steps, self.model = acts, ["blocks.0.hook_resid_post"], [0, 1], None

    def stack(self, name, phase=None):
        return self.acts


def test_mean_pool_divides_by_the_chosen_positions():
    acts = torch.arange(2 * 2 * 4 * 2, dtype=torch.float32).reshape(2, 2, 4, 2)     # [step, item, pos, d]
    pos = torch.tensor([[1, 0, 1, 0], [0, 1, 1, 1]], dtype=torch.bool)               # 2 and 3 chosen
    f = features_from_cache(_FakeCache(acts), pool="mean", positions=pos)
    want = torch.stack([acts[:, 0, [0, 2]].mean(1), acts[:, 1, [1, 2, 3]].mean(1)], 1)
    torch.testing.assert_close(f.acts[0], want, rtol=0, atol=1e-6)


def test_binary_accuracy_thresholds_the_logit_at_zero():
    g = torch.Generator().manual_seed(2)
    labels = torch.tensor([0, 1] * 10)
    acts = (torch.randn(1, 1, 20, 2, generator=g, dtype=torch.float64) * 0.3
            + (labels[:, None] * 2 - 1) * torch.tensor([1.0, 0.5], dtype=torch.float64))
    l2 = 20.0   # a strong penalty: small logits, many of them in (0, 0.5)
    t = probe_grid(ProbeFeatures(acts, [0], [0]), labels, n_boot=0, l2=l2, seed=1, test_fraction=0.5)
    train, test = torch.tensor(t.attrs["train_items"]), torch.tensor(t.attrs["test_items"])
    xtr, xte, tr, te = _standardised(acts[0, 0], torch.arange(20), train, test)
    w, b = fit_logistic(xtr, labels[tr], n_classes=2, l2=l2)
    z = (xte @ w + b)[:, 0]
    assert ((z > 0) & (z <= 0.5)).any()              # the planted case separates threshold 0 from 0.5
    want = float(((z > 0).long() == labels[te]).double().mean())
    assert t.set_index("metric").value["accuracy"] == pytest.approx(want, abs=1e-12)
