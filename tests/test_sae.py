"""mdm_lens.sae on the shipped twin: MaskedCanvas (no sae-lens needed), and with sae-lens installed
(the second CI venv, transformer-lens 3.x): identity splice, step binding, hook removal, steering,
the diffusion CE score, and a few steps of SAELens' own training runner on the masked canvas."""

import copy
import importlib.util
import math

import pytest
import torch

from mdm_lens import steps
from mdm_lens.errors import ArgumentError, InputError
from mdm_lens.sae import MaskedCanvas

HOOK = "blocks.1.hook_resid_post"


def _ids(model, n=6, width=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, model.cfg.d_vocab, (n, width), generator=g)
    ids[:, 0] = model.cfg.bos_token_id
    return ids


# --- MaskedCanvas ------------------------------------------------------------------------------------
def test_canvas_masks_like_training_and_returns_the_chosen_positions(mdm):
    ids = _ids(mdm)
    ids[1, 8:] = mdm.cfg.pad_token_id
    canvas = MaskedCanvas(mdm, mask_rate=0.5, positions="masked", seed=3)
    noisy, masked = canvas.mask(ids)
    assert not masked[:, 0].any() and not masked[1, 8:].any()  # <bos> and pads never masked
    assert (noisy[masked] == mdm.cfg.mask_token_id).all() and (noisy[~masked] == ids[~masked]).all()
    # the same seed draws the same masks; the next call draws new ones
    again = MaskedCanvas(mdm, mask_rate=0.5, seed=3)
    assert torch.equal(again.mask(ids)[1], masked) and not torch.equal(again.mask(ids)[1], masked)
    # run_with_cache: exactly the model's activations on the noisy canvas, at the masked positions
    canvas = MaskedCanvas(mdm, mask_rate=0.5, positions="masked", seed=3)
    _, acts = canvas.run_with_cache(ids, names_filter=[HOOK], stop_at_layer=2, prepend_bos=False)
    _, ref = mdm.run_with_cache(noisy, names_filter=[HOOK])
    assert acts[HOOK].shape == (1, int(masked.sum()), mdm.cfg.d_model)
    torch.testing.assert_close(acts[HOOK][0], ref[HOOK][masked], rtol=0, atol=0)
    un = MaskedCanvas(mdm, mask_rate=0.5, positions="unmasked", seed=3).run_with_cache(ids, names_filter=[HOOK])[1]
    torch.testing.assert_close(un[HOOK][0], ref[HOOK][~masked], rtol=0, atol=0)


def test_canvas_llada_schedule_rates_and_arguments(mdm, arm):
    canvas = MaskedCanvas(mdm, seed=0)
    r = canvas.rates(4000)
    assert r.min() >= 1e-3 and r.max() <= 1.0 and abs(r.mean().item() - 0.5) < 0.02  # (1-eps)U(0,1)+eps
    ids = _ids(mdm, n=400, width=40)
    frac = MaskedCanvas(mdm, mask_rate=0.25, seed=1).mask(ids)[1][:, 1:].float().mean().item()
    assert abs(frac - 0.25) < 0.01
    with pytest.raises(ArgumentError, match="mask_rate"):
        MaskedCanvas(mdm, mask_rate=0.0)
    with pytest.raises(ArgumentError, match="positions"):
        MaskedCanvas(mdm, positions="some")
    with pytest.raises(InputError, match="causal"):
        MaskedCanvas(arm)
    with pytest.raises(InputError, match="mask_rate"):
        MaskedCanvas(mdm, mask_rate=lambda b, g: torch.full((b,), 2.0)).mask(ids)


# --- with sae-lens -----------------------------------------------------------------------------------
needs_sae_lens = pytest.mark.skipif(importlib.util.find_spec("sae_lens") is None,
                                    reason="sae-lens is not installed (pip install -e '.[sae]'; CI runs these in "
                                    "its transformer-lens 3.x venv)")


def identity_sae(d):
    """relu(x) - relu(-x) = x: W_enc = [I, -I], W_dec = [I; -I], no biases -- an exact reconstruction."""
    from sae_lens import StandardSAE, StandardSAEConfig

    sae = StandardSAE(StandardSAEConfig(d_in=d, d_sae=2 * d, apply_b_dec_to_input=False))
    eye = torch.eye(d)
    with torch.no_grad():
        sae.W_enc.copy_(torch.cat([eye, -eye], 1))
        sae.W_dec.copy_(torch.cat([eye, -eye], 0))
        sae.b_enc.zero_()
        sae.b_dec.zero_()
    return sae


@needs_sae_lens
def test_identity_sae_leaves_the_trajectory_identical_and_recovers_all_ce(mdm):
    from mdm_lens.sae import diffusion_ce_score, sae_hook

    sae = identity_sae(mdm.cfg.d_model)
    prompt = _ids(mdm, n=2, width=6)
    ref = mdm.generate(prompt, steps=4, gen_length=8)
    out = mdm.generate(prompt, steps=4, gen_length=8, fwd_hooks=[sae_hook(sae, HOOK)])
    assert torch.equal(ref.tokens, out.tokens)
    score = diffusion_ce_score(mdm, sae, HOOK, _ids(mdm), mask_rates=(0.3, 0.7), seeds=(0, 1))
    assert len(score) == 4
    assert ((score.ce_recovered - 1).abs() < 1e-9).all() and (score.fvu.abs() < 1e-12).all()
    assert ((score.l0 - mdm.cfg.d_model).abs() < 1e-9).all()  # one of relu(x_j), relu(-x_j) per nonzero x_j
    assert (score.ce_zero != score.ce_clean).all()


@needs_sae_lens
def test_zero_sae_recovers_nothing_and_ce_formula(mdm):
    from mdm_lens.sae import diffusion_ce_score

    sae = identity_sae(mdm.cfg.d_model)
    with torch.no_grad():
        sae.W_dec.zero_()  # reconstruction 0 = the zero ablation
    s = diffusion_ce_score(mdm, sae, HOOK, _ids(mdm), mask_rates=(0.5,), seeds=(2,))
    assert abs(s.ce_recovered[0]) < 1e-9 and abs(s.fvu[0] - 1) > 0  # recons 0: FVU = E|x|^2/Var > 1
    assert s.ce_sae[0] == pytest.approx(s.ce_zero[0], abs=1e-9)


@needs_sae_lens
def test_ce_recovered_is_nan_with_a_reason_when_ablation_changes_nothing(mdm):
    from mdm_lens.sae import diffusion_ce_score

    # planted: with a zero embedding matrix, hook_embed is already 0, so zero-ablating it is a no-op
    m = copy.deepcopy(mdm)
    with torch.no_grad():
        m.embed.W_E.zero_()
    s = diffusion_ce_score(m, identity_sae(m.cfg.d_model), "hook_embed", _ids(m), mask_rates=(0.5,))
    assert math.isnan(s.ce_recovered[0]) and "ce_zero == ce_clean" in s.note[0]
    assert math.isnan(s.fvu[0]) and "zero variance" in s.note[0]


@needs_sae_lens
def test_splice_fires_only_at_the_chosen_steps_and_steers(mdm):
    from mdm_lens.sae import sae_hook

    sae = identity_sae(mdm.cfg.d_model)
    fired = []
    h = sae_hook(sae, HOOK, sae_fwd_hooks=[("hook_sae_acts_post", lambda a, hook: fired.append(mdm.state.step))])
    prompt = _ids(mdm, n=1, width=6)
    mdm.generate(prompt, steps=6, gen_length=6, fwd_hooks=[h @ steps(1, -1)])
    assert fired == [1, 5]
    # steering at step 0 only: the step-0 logits move by exactly what adding alpha * W_dec[i] does
    i, alpha = 7, 3.0
    steer = sae_hook(sae, HOOK, steer={i: alpha}) @ steps(0)
    canvas = torch.cat([prompt, torch.full((1, 6), mdm.cfg.mask_token_id)], 1)
    want = mdm.run_with_hooks(canvas, fwd_hooks=[(HOOK, lambda x, hook: x + alpha * sae.W_dec[i])])
    got = mdm.run_with_hooks(canvas, fwd_hooks=[(steer.name, steer.fn)])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ArgumentError, match="steer"):
        sae_hook(sae, HOOK, steer={2 * mdm.cfg.d_model: 1.0})
    with pytest.raises(InputError, match="hook_sae_nope"):
        sae_hook(sae, HOOK, sae_fwd_hooks=[("hook_sae_nope", lambda a, hook: None)])


@needs_sae_lens
def test_hooks_are_removed_after_a_raise(mdm):
    from mdm_lens.sae import sae_hook

    sae = identity_sae(mdm.cfg.d_model)

    def boom(a, hook):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        mdm.generate(_ids(mdm, n=1, width=6), steps=3, gen_length=4,
                     fwd_hooks=[sae_hook(sae, HOOK, sae_fwd_hooks=[("hook_sae_acts_post", boom)]) @ steps(1)])
    assert all(not hp.fwd_hooks for hp in sae.hook_dict.values())
    assert all(not hp.fwd_hooks for hp in mdm.hook_dict.values())
    assert sae.use_error_term is False


@needs_sae_lens
def test_error_term_makes_any_sae_exact(mdm):
    from sae_lens import TopKSAE, TopKSAEConfig

    from mdm_lens.sae import sae_hook

    sae = TopKSAE(TopKSAEConfig(d_in=mdm.cfg.d_model, d_sae=64, k=4))
    prompt = _ids(mdm, n=2, width=6)
    ref = mdm.generate(prompt, steps=4, gen_length=6)
    lossy = sae_hook(sae, HOOK, use_error_term=True)
    out = mdm.generate(prompt, steps=4, gen_length=6, fwd_hooks=[lossy])
    assert torch.equal(ref.tokens, out.tokens)


@needs_sae_lens
def test_saelens_runner_trains_on_the_masked_canvas(mdm):
    datasets = pytest.importorskip("datasets")
    from sae_lens import (LanguageModelSAERunnerConfig, LanguageModelSAETrainingRunner, LoggingConfig,
                          StandardTrainingSAE, StandardTrainingSAEConfig)

    sae_cfg = StandardTrainingSAEConfig(d_in=mdm.cfg.d_model, d_sae=256)
    torch.manual_seed(0)
    sae = StandardTrainingSAE(sae_cfg)
    before = copy.deepcopy(sae)
    ds = datasets.Dataset.from_dict({"input_ids": _ids(mdm, n=64, width=16).tolist()})
    cfg = LanguageModelSAERunnerConfig(
        sae=sae_cfg, model_name="mdm-lens/tiny-mdm", hook_name=HOOK, dataset_path="unused",
        is_dataset_tokenized=True, context_size=16, training_tokens=4096, train_batch_size_tokens=64,
        store_batch_size_prompts=8, n_batches_in_buffer=4, device="cpu", act_store_device="cpu",
        logger=LoggingConfig(log_to_wandb=False), output_path=None, n_eval_batches=0,
        exclude_special_tokens=False, lr=1e-3, streaming=False)
    trained = LanguageModelSAETrainingRunner(cfg, override_dataset=ds, override_model=MaskedCanvas(mdm, seed=0),
                                             override_sae=sae).run()
    acts = MaskedCanvas(mdm, seed=99).run_with_cache(_ids(mdm, n=16, width=16, seed=5), names_filter=[HOOK])[1][HOOK]
    with torch.no_grad():
        mse = [((s.decode(s.encode(acts)) - acts) ** 2).mean().item() for s in (before, trained)]
    assert mse[1] < 0.5 * mse[0], mse


@needs_sae_lens
@pytest.mark.parametrize("kind", ["standard", "topk", "jumprelu"])
def test_any_saved_sae_splices_its_reconstruction(mdm, tmp_path, kind):
    from sae_lens import SAE

    from mdm_lens.sae import sae_hook

    d = mdm.cfg.d_model
    torch.manual_seed(1)
    cfg = {"standard": {}, "topk": {"k": 5}, "jumprelu": {}}[kind]
    sae = SAE.from_dict({"architecture": kind, "d_in": d, "d_sae": 48, "dtype": "float32", "device": "cpu", **cfg})
    with torch.no_grad():
        for p in sae.parameters():
            p.normal_(0, 0.1)
        if kind == "jumprelu":
            sae.threshold.fill_(0.05)
    sae.save_model(tmp_path)
    loaded = SAE.load_from_disk(tmp_path)
    assert type(loaded) is type(sae)
    canvas = torch.cat([_ids(mdm, n=2, width=5), torch.full((2, 4), mdm.cfg.mask_token_id)], 1)
    h = sae_hook(loaded, HOOK)
    seen = {}

    def manual(x, hook):
        seen["x"] = x
        return loaded.decode(loaded.encode(x))

    want = mdm.run_with_hooks(canvas, fwd_hooks=[(HOOK, manual)])
    got = mdm.run_with_hooks(canvas, fwd_hooks=[(h.name, h.fn)])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    clean = mdm(canvas)
    assert (got - clean).abs().max() > 1e-3  # a lossy SAE does change the logits
    l0 = (loaded.encode(seen["x"]) != 0).sum(-1).float()
    if kind == "topk":
        assert (l0 <= 5).all()
