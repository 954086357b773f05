"""mdm_lens.lens.linear: planted features found exactly where they are planted (on tensors and, through a hook,
on the shipped twin), item-level splits that cannot leak, hand-computed AUC / R², ridge and logistic fits,
NaN with a reason for undefined metrics, typed argument errors."""

import math
from fractions import Fraction

import pytest
import torch

from mdm_lens import at_steps, steps
from mdm_lens.errors import ArgumentError, ArgumentTypeError, InputError
from mdm_lens.lens import (POOLED, ProbeFeatures, auc, features_from_cache, fit_logistic, fit_ridge, item_split,
                           probe_grid, r2)
from mdm_lens.lens.linear import _auc_weighted


@pytest.fixture
def one_thread():
    """Tiny-model generation is thousands of small ops; on a shared CPU a thread pool only adds barriers."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _cell(table, layer, step, metric):
    row = table[(table.layer == layer) & (table.step == step) & (table.metric == metric)]
    assert len(row) == 1
    return row.iloc[0]


# --- metrics -------------------------------------------------------------------------------------------------
def test_auc_of_hand_cases_with_ties_is_exact():
    # pos {0.2, 0.5, 0.9} vs neg {0.5, 0.1}: pairs won 1 + (0.5 + 1) + 2 = 4.5 of 6 (the 0.5 tie counts 1/2)
    assert auc(y_true=torch.tensor([1, 0, 1, 1, 0]), y_score=torch.tensor([0.2, 0.5, 0.5, 0.9, 0.1])) == 0.75
    # pos {2, 3, 3, 0} vs neg {1, 2, 3}: 1.5 + 2.5 + 2.5 + 0 = 6.5 of 12 = 13/24
    s, y = torch.tensor([1.0, 2, 2, 3, 3, 3, 0]), torch.tensor([False, True, False, True, True, False, True])
    assert auc(y_true=y, y_score=s) == float(Fraction(13, 24))
    assert auc(y_true=y, y_score=-s) == float(Fraction(11, 24))  # reversing the scores gives 1 - AUC with ties
    assert math.isnan(auc(y_true=torch.ones(7, dtype=torch.long), y_score=s))


def test_auc_matches_pairwise_counts_and_bootstrap_weights_replicate_samples():
    g = torch.Generator().manual_seed(0)
    s = torch.randint(0, 5, (40,), generator=g).double()  # many ties
    y = torch.randint(0, 2, (40,), generator=g)
    pos, neg = s[y == 1], s[y == 0]
    diff = pos[:, None] - neg[None, :]
    pairwise = ((diff > 0).double() + 0.5 * (diff == 0).double()).mean()
    assert abs(auc(y_true=y, y_score=s) - float(pairwise)) < 1e-12
    w = torch.randint(0, 3, (1, 40), generator=g).double()  # weight k = the sample k times
    rep = torch.repeat_interleave(torch.arange(40), w[0].long())
    assert abs(float(_auc_weighted(s, y.double(), w)[0]) - auc(y_true=y[rep], y_score=s[rep])) < 1e-12


def test_r2_hand_case_and_constant_target():
    assert r2(y_true=torch.tensor([1.0, 2, 3, 4]), y_pred=torch.tensor([1.0, 2, 3, 5])) == pytest.approx(0.8, abs=1e-15)
    assert math.isnan(r2(y_true=torch.tensor([0.1, 0.1, 0.1]), y_pred=torch.tensor([0.0, 0.1, 0.2])))


# --- fits ----------------------------------------------------------------------------------------------------
def test_ridge_on_noiseless_linear_data_gives_r2_one():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(120, 6, generator=g, dtype=torch.float64)
    y = x @ torch.tensor([1.0, -2, 0.5, 0, 3, 1], dtype=torch.float64) + 3
    w, b = fit_ridge(x[:80], y[:80], alpha=0.0)
    assert abs(r2(y_true=y[80:], y_pred=x[80:] @ w + b) - 1) < 1e-6
    w1, _ = fit_ridge(x[:80], y[:80], alpha=10.0)
    assert w1.norm() < w.norm()  # the penalty shrinks the weights
    # d > n: the dual (n x n) solve gives the primal solution
    wide = torch.randn(10, 30, generator=g, dtype=torch.float64)
    wd, bd = fit_ridge(wide, wide[:, 0], alpha=0.5)
    xc = wide - wide.mean(0)
    yc = wide[:, 0] - wide[:, 0].mean()
    primal = torch.linalg.solve(xc.T @ xc + 0.5 * torch.eye(30, dtype=torch.float64), xc.T @ yc)
    torch.testing.assert_close(wd, primal, atol=1e-10, rtol=1e-10)


def test_logistic_on_separable_data_separates_and_is_a_stationary_point():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(80, 5, generator=g, dtype=torch.float64)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    x[:, 0] += torch.where(y == 1, 0.5, -0.5)  # a margin: separable
    w, b = fit_logistic(x, y, l2=1e-2)
    z = x @ w[:, 0] + b[0]
    assert ((z > 0).long() == y).all() and auc(y_true=y, y_score=z) == 1.0 and torch.isfinite(w).all()
    # the L2 objective's gradient vanishes at the returned point
    p = torch.sigmoid(z)
    grad_w = x.T @ (p - y.double()) / len(y) + 1e-2 * w[:, 0]
    assert grad_w.abs().max() < 1e-6 and abs(float((p - y.double()).mean())) < 1e-6
    w_small, _ = fit_logistic(x, y, l2=1e-3)
    assert w_small.norm() > w.norm()  # on separable data only the penalty bounds the weights
    w2, b2 = fit_logistic(x, y, l2=1e-2)
    assert torch.equal(w, w2) and torch.equal(b, b2)  # deterministic


# --- split ---------------------------------------------------------------------------------------------------
def test_item_split_is_disjoint_covering_and_stratified():
    train, test = item_split(40, test_fraction=0.25, seed=3)
    assert set(train.tolist()).isdisjoint(test.tolist()) and sorted(train.tolist() + test.tolist()) == list(range(40))
    assert len(test) == 10
    labels = torch.tensor([0] * 30 + [1] * 10)
    train, test = item_split(40, test_fraction=0.2, seed=3, stratify=labels)
    assert (labels[test] == 0).sum() == 6 and (labels[test] == 1).sum() == 2
    assert torch.equal(item_split(40, seed=3)[1], item_split(40, seed=3)[1])


def test_pooled_steps_never_score_an_item_seen_in_training():
    """Each item has one random vector repeated at every step and a random target: only memorising the item can
    predict it. Split by item, the pooled probe cannot; split by sample (leaky) the same ridge fit would."""
    g = torch.Generator().manual_seed(0)
    n_items, n_steps, d = 40, 6, 64
    per_item = torch.randn(n_items, d, generator=g)
    acts = per_item[None, None].expand(1, n_steps, n_items, d).clone()
    y = torch.randn(n_items, generator=g, dtype=torch.float64)
    table = probe_grid(acts, y, probe="ridge", pool_steps=True, alpha=1e-3, n_boot=50)
    row = _cell(table, 0, POOLED, "r2")
    assert row.value < 0.5 and row.n_train + row.n_test == n_items
    assert set(table.attrs["train_items"]).isdisjoint(table.attrs["test_items"])
    # the counterfactual: a split over (step, item) samples puts every test item's other steps in training
    x, t = acts[0].reshape(-1, d).double(), y[None].expand(n_steps, -1).reshape(-1)
    perm = torch.randperm(len(t), generator=g)
    w, b = fit_ridge(x[perm[:180]], t[perm[:180]], alpha=1e-3)
    assert r2(y_true=t[perm[180:]], y_pred=x[perm[180:]] @ w + b) > 0.99


# --- planted features ----------------------------------------------------------------------------------------
def test_planted_feature_on_tensors_gives_auc_one_only_where_planted():
    """Cells without the feature hold the same vector for every item (AUC exactly 1/2: all scores tie); the
    planted cells separate the classes by a margin (AUC exactly 1, its bootstrap CI [1, 1])."""
    g = torch.Generator().manual_seed(0)
    n_layer, n_step, n_items, d = 3, 4, 48, 6
    acts = torch.randn(n_layer, n_step, 1, d, generator=g).expand(-1, -1, n_items, -1).clone()
    label = torch.randint(0, 2, (n_items,), generator=g)
    planted = {(1, 2), (1, 3), (2, 0)}
    for layer, step in planted:
        acts[layer, step, :, 0] += 3.0 * (2 * label - 1) + 0.1 * torch.randn(n_items, generator=g)
    table = probe_grid(ProbeFeatures(acts, [0, 1, 2], [0, 4, 8, 12]), label, n_boot=200)
    assert len(table) == n_layer * n_step * 2 and (table.n_test == 12).all() and (table.reason == "").all()
    for layer in range(n_layer):
        for i, step in enumerate([0, 4, 8, 12]):
            row = _cell(table, layer, step, "auc")
            if (layer, i) in planted:
                assert (row.value, row.ci_low, row.ci_high) == (1.0, 1.0, 1.0)
            else:
                assert row.value == 0.5


def test_multiclass_target_macro_auc_and_per_position_samples():
    """Gold passage index (3 classes) planted at one cell; per-position features where the excluded positions
    are NaN: they must never be read."""
    g = torch.Generator().manual_seed(1)
    n_items, n_pos, d = 45, 3, 4
    gold = torch.arange(n_items) % 3
    acts = torch.randn(2, 2, n_items, n_pos, d, generator=g)
    acts[1, 0, :, :, :3] += 4 * torch.nn.functional.one_hot(gold, 3)[:, None, :].float()
    positions = torch.ones(n_items, n_pos, dtype=torch.bool)
    positions[:, 2] = False
    acts[:, :, :, 2] = float("nan")
    table = probe_grid(ProbeFeatures(acts, [0, 1], [0, 1], positions), gold, n_boot=100)
    assert table.attrs["classes"] == [0, 1, 2]
    assert _cell(table, 1, 0, "auc").value == 1.0 and _cell(table, 1, 0, "accuracy").value == 1.0
    assert _cell(table, 0, 0, "auc").value < 0.8


def test_latent_step_is_read_by_a_pooled_ridge_probe():
    g = torch.Generator().manual_seed(2)
    acts = torch.randn(2, 5, 30, 8, generator=g)
    acts[1, :, :, 3] = torch.tensor([0.0, 2, 4, 6, 8])[:, None]  # layer 1 writes the step into a direction
    table = probe_grid(ProbeFeatures(acts, [0, 1], [0, 2, 4, 6, 8]), "step", probe="ridge", pool_steps=True,
                       alpha=1e-6, n_boot=100)
    assert list(table.step) == [POOLED, POOLED]
    assert abs(_cell(table, 1, POOLED, "r2").value - 1) < 1e-6 and _cell(table, 0, POOLED, "r2").value < 0.2


# --- undefined metrics ---------------------------------------------------------------------------------------
def test_undefined_metrics_are_nan_with_a_reason():
    g = torch.Generator().manual_seed(0)
    n = 20
    acts = torch.randn(1, 3, n, 4, generator=g)
    train, test = item_split(n, test_fraction=0.25, seed=0)
    label = torch.randint(0, 2, (3, n), generator=g)
    label[:, train[:2]] = torch.tensor([0, 1])           # both classes in train at every step
    label[1, test] = 1                                   # step 1: the test split holds one class only
    label[2] = 1                                         # step 2: one class everywhere
    table = probe_grid(acts, label, n_boot=50)
    assert not math.isnan(_cell(table, 0, 0, "auc").value)
    one = _cell(table, 0, 1, "auc")
    assert math.isnan(one.value) and math.isnan(one.ci_low) and "lacks class(es) [0]" in one.reason
    assert not math.isnan(_cell(table, 0, 1, "accuracy").value)
    both = table[table.step == 2]
    assert both.value.isna().all() and both.reason.str.contains("one class only in the train split").all()
    y = torch.randn(3, n, generator=g, dtype=torch.float64)
    y[1, test] = 0.1
    ridge = probe_grid(acts, y, probe="ridge", n_boot=50)
    assert math.isnan(_cell(ridge, 0, 1, "r2").value) and "constant target" in _cell(ridge, 0, 1, "r2").reason
    assert not math.isnan(_cell(ridge, 0, 0, "r2").value)


def test_arguments_raise_typed_errors_naming_the_argument():
    acts, y = torch.randn(1, 2, 10, 3), torch.randint(0, 2, (10,))
    cases = [(dict(probe="svm"), ArgumentError, "probe"), (dict(test_fraction=1.0), ArgumentError, "test_fraction"),
             (dict(n_boot=-1), ArgumentError, "n_boot"), (dict(l2=0.0), ArgumentError, "l2"),
             (dict(pool_steps=1), ArgumentTypeError, "pool_steps")]
    for kwargs, error, name in cases:
        with pytest.raises(error, match=name):
            probe_grid(acts, y, **kwargs)
    with pytest.raises(ArgumentTypeError, match="class labels"):
        probe_grid(acts, y.double())
    with pytest.raises(InputError, match="target has shape"):
        probe_grid(acts, torch.zeros(7, dtype=torch.long))
    with pytest.raises(ArgumentError, match="latent step"):
        probe_grid(acts, "step", probe="ridge")
    with pytest.raises(ArgumentError, match="features"):
        probe_grid(torch.randn(2, 10, 3), y)
    with pytest.raises(ArgumentError, match="features"):
        probe_grid(acts.clone().fill_(float("nan")), y)


# --- end to end on the twin ----------------------------------------------------------------------------------
def test_planted_direction_in_resid_post_at_known_steps_on_the_twin(mdm, one_thread):
    """+v (sign by label) into blocks.1.hook_resid_post at steps 1 and 2, and -v again at blocks.2.hook_resid_pre:
    the cache sees the planted layer-1 stream, while every later layer and step computes what it would have
    without the plant (the tokens equal an unhooked run). So AUC ~ 1 at (layer 1, steps 1-2) and chance
    everywhere else."""
    n, d = 64, mdm.cfg.d_model
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(5, mdm.cfg.d_vocab, (n, 10), generator=g)
    prompts[:, 0] = mdm.cfg.bos_token_id
    label = torch.randint(0, 2, (n,), generator=g)
    v = torch.randn(d, generator=g)
    push = (2 * label - 1).float()[:, None, None] * (8 * v / v.norm())
    hooks = [at_steps(lambda x, hook: x + push, [1, 2], name="blocks.1.hook_resid_post"),
             at_steps(lambda x, hook: x - push, [1, 2], name="blocks.2.hook_resid_pre")]
    out = mdm.generate(prompts, steps=4, gen_length=4, fwd_hooks=hooks, cache="blocks.*.hook_resid_post" @ steps())
    assert torch.equal(out.tokens, mdm.generate(prompts, steps=4, gen_length=4).tokens)
    feats = features_from_cache(out.cache, pool="mean")
    manual = out.cache.stack("blocks.3.hook_resid_post")[2].mean(1)
    torch.testing.assert_close(feats.acts[3, 2], manual, atol=1e-6, rtol=1e-6)
    table = probe_grid(feats, label, test_fraction=0.5, n_boot=200)
    for layer in range(mdm.cfg.n_layers):
        for step in range(4):
            row = _cell(table, layer, step, "auc")
            if layer == 1 and step in (1, 2):
                assert row.value > 0.99 and row.ci_low > 0.9
            else:
                assert row.value < 0.85, (layer, step, row.value)
    masked = out.trajectory.x_steps == mdm.cfg.mask_token_id  # [step, item, pos]: still masked before the step
    last = features_from_cache(out.cache, pool="last", layers=[-3], positions=masked)
    assert last.layers == [1] and last.acts.shape == (1, 4, n, d)
    where = masked.long().cumsum(-1).argmax(-1)  # the last masked position of each item at each step
    stream = out.cache.stack("blocks.1.hook_resid_post")
    assert torch.equal(last.acts[0, 3, 5], stream[3, 5, where[3, 5]])
    with pytest.raises(InputError, match="selects no position"):
        features_from_cache(out.cache, positions=torch.zeros_like(masked))
    with pytest.raises(InputError, match="holds no blocks"):
        features_from_cache(out.cache, hook="hook_attn_out")
    with pytest.raises(InputError, match="positions has shape"):
        features_from_cache(out.cache, positions=masked[:, :, :3].clone())


def test_auc_and_r2_take_y_true_first_by_keyword_only():
    """Both follow sklearn (y_true first) and refuse positional calls: with float 0/1 labels a swapped positional
    call would pass every check and give another number."""
    from mdm_lens.errors import ArgumentTypeError

    y, s = torch.tensor([0.0, 1.0, 1.0, 0.0]), torch.tensor([0.1, 0.9, 0.4, 0.3])
    with pytest.raises(ArgumentTypeError, match="keyword"):
        auc(y, s)
    with pytest.raises(ArgumentTypeError, match="keyword"):
        r2(y, s)
    with pytest.raises(ArgumentTypeError, match="y_score"):
        auc(y_true=y.long())
    assert auc(y_true=y.long(), y_score=s) == 1.0
    assert r2(y_true=y, y_pred=y) == 1.0
