"""A tuned lens is bound to the model it was made for (cfg + a weight fingerprint) and never runs with NaN
parameters."""

import copy
import json

import pytest
import torch

from mdm_lens.errors import InputError, NonFiniteError
from mdm_lens.lens import TunedLens, lens_logits, lens_trace, train_tuned_lens
from mdm_lens.lens.tuned import CONFIG, model_identity

from ._lensfix import run, twin_prompts
from .test_lens_tuned import zoo_sequences


@pytest.fixture(scope="module")
def lens(mdm):
    ids, am = zoo_sequences(16, seed=1)
    return train_tuned_lens(mdm, ids, attention_mask=am, n_steps=3, batch_size=4, seed=0)


@pytest.fixture(scope="module")
def sibling(mdm):
    """The same shapes and cfg, one weight nudged: a different checkpoint the shape check alone would accept."""
    other = copy.deepcopy(mdm)
    with torch.no_grad():
        dict(other.named_parameters())["blocks.1.mlp.down_weight"].view(-1)[0] += 0.5
    return other


def test_identity_names_the_model_and_tells_checkpoints_apart(mdm, sibling, lens):
    ident = model_identity(mdm)
    assert ident["model_name"] == "mdm-lens/tiny-mdm" and ident["n_layers"] == mdm.cfg.n_layers
    assert lens.model_identity == ident == model_identity(copy.deepcopy(mdm))
    assert model_identity(sibling)["fingerprint"] != ident["fingerprint"]


def test_load_onto_another_model_of_the_same_shapes_is_refused(mdm, sibling, lens, tmp_path):
    lens.save(tmp_path / "l")
    assert json.loads((tmp_path / "l" / CONFIG).read_text())["model_identity"] == model_identity(mdm)
    TunedLens.load(tmp_path / "l", mdm)
    with pytest.raises(InputError, match="fingerprint") as e:
        TunedLens.load(tmp_path / "l", sibling)
    assert "strict=False" in str(e.value)
    out = run(sibling, *twin_prompts(sibling))
    with pytest.raises(InputError, match="another model"):
        lens_trace(sibling, out, lens=lens)
    loose = TunedLens.load(tmp_path / "l", sibling, strict=False)
    got = lens_trace(sibling, out, lens=loose, layers=[0])
    assert torch.isfinite(got.final_prob).all()


def test_a_file_without_identity_checks_shapes_only(mdm, sibling, lens, tmp_path):
    lens.save(tmp_path / "old")
    cfg = json.loads((tmp_path / "old" / CONFIG).read_text())
    del cfg["model_identity"]
    (tmp_path / "old" / CONFIG).write_text(json.dumps(cfg))
    assert TunedLens.load(tmp_path / "old", sibling).model_identity is None


def test_nan_parameters_are_refused_at_load_and_use(mdm, lens, tmp_path):
    bad = copy.deepcopy(lens)
    with torch.no_grad():
        bad.bias[1][3] = float("nan")
    resid = torch.randn(1, 4, mdm.cfg.d_model)
    with pytest.raises(NonFiniteError, match="bias.1"):
        lens_logits(mdm, resid, 1, lens=bad)
    with pytest.raises(NonFiniteError, match="bias.1"):
        bad.translate(resid, 1)
    out = run(mdm, *twin_prompts(mdm))
    with pytest.raises(NonFiniteError):
        lens_trace(mdm, out, lens=bad)
    bad.save(tmp_path / "bad")
    with pytest.raises(NonFiniteError, match="bias.1"):
        TunedLens.load(tmp_path / "bad")


def test_a_diverged_fit_is_refused(mdm):
    ids, am = zoo_sequences(8, seed=1)
    with pytest.raises(NonFiniteError, match="retrain"):
        train_tuned_lens(mdm, ids, attention_mask=am, n_steps=4, batch_size=4, lr=1e36, seed=0)
