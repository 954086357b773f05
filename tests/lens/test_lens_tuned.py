"""The tuned lens: training on masked canvases lowers the held-out KL to the final logits below the logit lens',
is deterministic given the seed and leaves the model untouched; save/load round-trips exactly; typed errors."""


import pytest
import torch

from mdm_lens.errors import ArgumentError, ArgumentTypeError, CheckpointNotFoundError, InputError, OutOfRangeError
from mdm_lens.lens import TunedLens, lens_trace, masked_kl, train_tuned_lens

from ._lensfix import dream_model, run, twin_prompts

KW = dict(n_steps=15, batch_size=8, lr=5e-3, seed=0)


def zoo_sequences(n, seed):
    from mdm_lens.zoo import data as D
    from mdm_lens.zoo.batches import collate, encode_training_item

    b = collate([encode_training_item(it, 4) for it in D.make_dataset(n, seed=seed, n_distractors=1)])
    return b.ids, b.attention_mask


@pytest.fixture(scope="module")
def trained(mdm):
    ids, am = zoo_sequences(48, seed=1)
    return train_tuned_lens(mdm, ids, attention_mask=am, **KW)


def test_training_lowers_held_out_kl(mdm, trained):
    ids, am = zoo_sequences(24, seed=2)                       # other items, other masks
    base = masked_kl(mdm, ids, attention_mask=am, seed=5)
    tuned = masked_kl(mdm, ids, attention_mask=am, lens=trained, seed=5)
    assert torch.equal(masked_kl(mdm, ids, attention_mask=am, lens=TunedLens.identity(mdm), seed=5), base)
    assert base[-1] < 1e-6 and tuned[-1] < 1e-6               # the last layer's lens is the output itself
    assert (base[:-1] > 0.5).all()                            # the logit lens is far off below the top
    assert (tuned[:-1] < 0.8 * base[:-1]).all(), (base, tuned)
    assert trained.training_info["trained_layers"] == [0, 1, 2]
    loss = trained.training_info["loss"]
    assert len(loss) == KW["n_steps"] and sum(loss[-5:]) < sum(loss[:5])


def test_model_untouched_and_deterministic(mdm, trained):
    assert all(p.grad is None for p in mdm.parameters())
    ids, am = zoo_sequences(48, seed=1)
    again = train_tuned_lens(mdm, ids, attention_mask=am, **{**KW, "n_steps": 2})
    other = train_tuned_lens(mdm, ids, attention_mask=am, **{**KW, "n_steps": 2, "seed": 1})
    first = train_tuned_lens(mdm, ids, attention_mask=am, **{**KW, "n_steps": 2})
    assert all(torch.equal(a, b) for a, b in zip(again.parameters(), first.parameters()))
    assert not torch.equal(again.delta[0], other.delta[0])
    # the last layer's translator stays the identity
    assert not again.delta[-1].any() and not again.bias[-1].any()


def test_save_load_round_trip(mdm, trained, tmp_path):
    trained.save(tmp_path / "lens")
    back = TunedLens.load(tmp_path / "lens", mdm)
    assert back.layers == trained.layers and back.model_name == "mdm-lens/tiny-mdm"
    for a, b in zip(trained.parameters(), back.parameters()):
        assert torch.equal(a, b)
    assert back.training_info["loss"] == trained.training_info["loss"]
    out = run(mdm, *twin_prompts(mdm))
    t1, t2 = lens_trace(mdm, out, lens=trained), lens_trace(mdm, out, lens=back)
    assert torch.equal(t1.top1, t2.top1) and torch.equal(t1.final_prob, t2.final_prob)
    # the tuned lens is not the logit lens below the top
    assert not torch.equal(t1.final_prob[:, 0], lens_trace(mdm, out, layers=[0]).final_prob[:, 0])


def test_dream_shift_in_training_path():
    """With the shift, the last layer's identity lens reads the rows the model's aligned logits come from: KL 0."""
    model = dream_model()
    ids = torch.randint(4, 50, (6, 10), generator=torch.Generator().manual_seed(0))
    kl = masked_kl(model, ids, mask_rate=0.5, seed=0)
    assert kl[-1] < 1e-6 and (kl[:-1] > 1e-3).all()


def test_nan_when_nothing_is_masked(mdm):
    ids = torch.tensor([[1]])                                  # only <bos>: never masked
    assert torch.isnan(masked_kl(mdm, ids)).all()


def test_bad_arguments(mdm, tmp_path):
    ids, am = zoo_sequences(4, seed=3)
    with pytest.raises(ArgumentError):
        train_tuned_lens(mdm, ids, n_steps=0)
    with pytest.raises(ArgumentTypeError):
        train_tuned_lens(mdm, ids.float())
    with pytest.raises(InputError):
        train_tuned_lens(mdm, ids + 1000)
    with pytest.raises(InputError):
        train_tuned_lens(mdm, ids, layers=[-1])               # only the output layer
    with pytest.raises(OutOfRangeError):
        train_tuned_lens(mdm, ids, layers=[4])
    with pytest.raises(ArgumentError):
        train_tuned_lens(mdm, ids, lr=-1.0)
    with pytest.raises(ArgumentError):
        masked_kl(mdm, ids, attention_mask=am[:, :3])
    with pytest.raises(ArgumentTypeError):
        masked_kl(mdm, ids, lens="logit")
    with pytest.raises(OutOfRangeError):
        TunedLens.identity(mdm, layers=[0]).translate(torch.zeros(1, 1, 128), 2)
    with pytest.raises(InputError):
        masked_kl(dream_model(), torch.tensor([[1, 5]]), lens=TunedLens.identity(mdm))
    with pytest.raises(CheckpointNotFoundError):
        TunedLens.load(tmp_path / "nothing")


def test_translate_applies_resid_times_delta_transposed_plus_bias():
    """The documented translator resid + resid A_lᵀ + b_l on a planted non-symmetric A (a zero, identity or
    symmetric A cannot tell A from Aᵀ)."""
    import torch

    from mdm_lens.lens.tuned import TunedLens

    lens = TunedLens(3, 2, layers=[1])
    A = torch.tensor([[0.0, 2.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    with torch.no_grad():
        lens.delta[0].copy_(A)
        lens.bias[0].copy_(torch.tensor([0.5, 0.0, -1.0]))
    resid = torch.tensor([[1.0, 10.0, 100.0]])
    # resid Aᵀ = [Σ_j A[0, j] r_j, Σ_j A[1, j] r_j, Σ_j A[2, j] r_j] = [20, 0, 1]
    assert lens.translate(resid, 1).tolist() == [[1.0 + 20.0 + 0.5, 10.0, 100.0 + 1.0 - 1.0]]
