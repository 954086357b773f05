"""The SAE interop with any object that has encode/decode/W_dec (no sae-lens needed): the splice inside
`run_with_hooks`, the error term computed by mdm_lens (not by the SAE's forward), and the CE score's canvas rules."""

import contextlib

import pytest
import torch

from mdm_lens import HookedMDM, steps
from mdm_lens.errors import ArgumentError, InputError
from mdm_lens.sae import diffusion_ce_score, sae_hook

HOOK = "blocks.1.hook_resid_post"


class ToySAE(torch.nn.Module):
    """A ReLU SAE whose forward is decode(encode(x)) and never adds an error term (`use_error_term` is ignored)."""

    def __init__(self, d, seed=0, adds_error=False):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.W_enc = torch.nn.Parameter(torch.randn(d, 3 * d, generator=g) * 0.2)
        self.W_dec = torch.nn.Parameter(torch.randn(3 * d, d, generator=g) * 0.2)
        self.b_enc = torch.nn.Parameter(torch.randn(3 * d, generator=g) * 0.1)
        self.use_error_term, self.adds_error, self.fired = False, adds_error, 0

    def encode(self, x):
        return torch.relu(x @ self.W_enc + self.b_enc)

    def decode(self, a):
        return a @ self.W_dec

    def forward(self, x):
        self.fired += 1
        out = self.decode(self.encode(x))
        if self.adds_error and self.use_error_term:  # SAELens-like: must not be added twice
            out = out + (x - out)
        return out

    @contextlib.contextmanager
    def hooks(self, fwd_hooks=()):
        yield self


@pytest.fixture(scope="module")
def model():
    return HookedMDM.from_pretrained("mdm-lens/tiny-mdm")


def _ids(model):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(8, 60, (3, 10), generator=g)
    ids[:, 0] = model.cfg.bos_token_id
    return ids


def test_splice_inside_run_with_hooks_equals_manual_encode_decode(model):
    sae, ids = ToySAE(model.cfg.d_model), _ids(model)
    got = model.run_with_hooks(ids, fwd_hooks=[sae_hook(sae, HOOK)])
    want = model.run_with_hooks(ids, fwd_hooks=[(HOOK, lambda x, hook: sae.decode(sae.encode(x)))])
    clean = model(ids)
    assert sae.fired == 1
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert (got - clean).abs().max() > 1e-2                     # the splice changed something
    with model.hooks(fwd_hooks=[sae_hook(sae, HOOK, use_error_term=True)]):
        exact = model(ids)
    torch.testing.assert_close(exact, clean, rtol=0, atol=1e-4)  # with the error term the splice is exact
    assert all(not hp.fwd_hooks for hp in model.hook_dict.values())


def test_a_step_bound_hook_outside_generate_says_what_to_use(model):
    sae = ToySAE(model.cfg.d_model)
    with pytest.raises(ArgumentError, match="generate"):
        model.run_with_hooks(_ids(model), fwd_hooks=[sae_hook(sae, HOOK) @ steps(0)])
    assert all(not hp.fwd_hooks for hp in model.hook_dict.values())


@pytest.mark.parametrize("adds_error", [False, True])
def test_error_term_is_added_by_mdm_lens_once(model, adds_error):
    sae = ToySAE(model.cfg.d_model, adds_error=adds_error)
    s = diffusion_ce_score(model, sae, HOOK, _ids(model), mask_rates=(0.5,), seeds=(1,), use_error_term=True)
    assert s.ce_sae[0] == pytest.approx(s.ce_clean[0], abs=1e-5)
    assert s.ce_recovered[0] == pytest.approx(1.0, abs=1e-4)
    plain = diffusion_ce_score(model, sae, HOOK, _ids(model), mask_rates=(0.5,), seeds=(1,))
    assert abs(plain.ce_sae[0] - plain.ce_clean[0]) > 1e-3    # without it the toy SAE is lossy
    assert sae.use_error_term is False


def test_ce_score_canvas_rules(model):
    sae, ids = ToySAE(model.cfg.d_model), _ids(model)
    bad = ids.clone()
    bad[0, 3] = model.cfg.mask_token_id
    with pytest.raises(InputError, match="mask id"):
        diffusion_ce_score(model, sae, HOOK, bad)
    every = diffusion_ce_score(model, sae, HOOK, ids, mask_rates=(1.0,))
    assert every.n_masked[0] == 3 * 9 and "no input token" in every.note[0]
    assert every.ce_clean.notna().all()
    some = diffusion_ce_score(model, sae, HOOK, ids, mask_rates=(0.5,))
    assert "no input token" not in some.note[0]


class EditingSAE(ToySAE):
    """A toy SAE whose `hooks()` context applies its fwd_hooks to the latents inside `forward` (as SAELens'
    hook_sae_acts_post does): the planted edit of the test below."""

    def __init__(self, d, seed=0):
        super().__init__(d, seed)
        self._edits = ()

    @contextlib.contextmanager
    def hooks(self, fwd_hooks=()):
        self._edits = tuple(fwd_hooks)
        try:
            yield self
        finally:
            self._edits = ()

    def forward(self, x):
        acts = self.encode(x)
        for _, fn in self._edits:
            acts = fn(acts, None)
        return self.decode(acts)


def test_a_latent_edit_survives_the_error_term(model):
    """error = x − decode(encode(x)) of the UN-edited SAE: with an edit, splice = decode(edited) + error, which
    differs from x by exactly decode(edited) − decode(encode(x)) (an error taken from the edited output would
    cancel every edit)."""
    sae, ids = EditingSAE(model.cfg.d_model), _ids(model)
    kill = lambda acts, hook: acts * 0.0  # noqa: E731  (every latent off)
    seen = {}

    def grab(x, hook):
        seen["x"] = x.detach().clone()

    edited = sae_hook(sae, HOOK, use_error_term=True, sae_fwd_hooks=[("hook_sae_acts_post", kill)])
    with torch.no_grad():
        model.run_with_hooks(ids, fwd_hooks=[(HOOK, grab)])
        x = seen["x"]
        spliced = []
        model.run_with_hooks(ids, fwd_hooks=[edited, (HOOK, lambda y, hook: spliced.append(y.detach().clone()))])
    want = x - sae.decode(sae.encode(x))          # decode(0) = 0: the error term alone
    torch.testing.assert_close(spliced[0], want, rtol=0, atol=1e-5)
    assert (spliced[0] - x).abs().max() > 1e-2    # the edit is not cancelled


def test_ce_score_and_masked_canvas_on_a_model_without_pad_or_bos(tmp_path):
    # MDLM's config has no pad and no bos id: every position is maskable (`tokens != None` is the bool True, not a
    # mask, which used to crash here)
    from mdm_lens import HookedMDM
    from mdm_lens.sae import MaskedCanvas
    from mdm_lens.sae.score import diffusion_ce_score
    from tests.families.ddit_checkpoints import MDLM_CONFIG, write_ddit

    mdlm = HookedMDM.from_pretrained(str(write_ddit(tmp_path / "m", MDLM_CONFIG)[0]), load_tokenizer=False)
    assert mdlm.cfg.pad_token_id is None and mdlm.cfg.bos_token_id is None
    tokens = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(0))
    noisy, masked = MaskedCanvas(mdlm, mask_rate=1.0, positions="all", seed=0).mask(tokens)
    assert bool(masked.all()) and bool((noisy == mdlm.cfg.mask_token_id).all())
    table = diffusion_ce_score(mdlm, ToySAE(mdlm.cfg.d_model), "blocks.0.hook_resid_post", tokens, mask_rates=[0.5])
    assert int(table["n_masked"][0]) > 0 and table["ce_sae"].notna().all()
