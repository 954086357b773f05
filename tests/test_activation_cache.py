"""Our ActivationCache (run_with_cache and the trajectory's per-step caches): out-of-range layers and missing names
are typed errors naming the valid range / the nearest names; everything else is TL's."""

import pytest
import torch
from transformer_lens import ActivationCache

from mdm_lens import HookedMDM, steps
from mdm_lens.cache import MDMActivationCache
from mdm_lens.errors import ArgumentTypeError, HookNameError, OutOfRangeError


@pytest.fixture(scope="module")
def model():
    return HookedMDM.from_pretrained("mdm-lens/tiny-mdm")


@pytest.fixture(scope="module")
def caches(model):
    ids = torch.tensor([[1, 5, 6, 7, 9, 11]])
    _, run = model.run_with_cache(ids, names_filter=lambda n: n.endswith("hook_pattern"))
    out = model.generate(ids, gen_length=4, steps=2, cache=["blocks.*.attn.hook_pattern"] @ steps(0, 1))
    return run, out.cache[0]


@pytest.mark.parametrize("which", [0, 1])
def test_typed_errors_name_the_range_and_nearest_names(model, caches, which):
    cache = caches[which]
    n = model.cfg.n_layers
    assert isinstance(cache, ActivationCache) and isinstance(cache, MDMActivationCache)
    with pytest.raises(OutOfRangeError, match=rf"\[-{n}, {n - 1}\]"):
        cache["pattern", n]
    with pytest.raises(OutOfRangeError):
        cache["pattern", -n - 1]
    with pytest.raises(HookNameError, match="not cached") as e:
        cache["resid_pre", 0]
    assert isinstance(e.value, KeyError)                          # `except KeyError` still catches it
    with pytest.raises(HookNameError, match="no hook point.*blocks.1.attn.hook_pattern"):
        cache["blocks.1.attn.hook_patern"]
    with pytest.raises(ArgumentTypeError):
        cache["pattern", 1.0]
    with pytest.raises(ArgumentTypeError):
        cache[3]


def test_everything_else_is_tl(model, caches):
    run, step0 = caches
    n = model.cfg.n_layers
    assert torch.equal(run["pattern", -1], run[f"blocks.{n - 1}.attn.hook_pattern"])
    assert torch.equal(run["pattern", 0], run["blocks.0.attn.hook_pattern"])
    assert run.stack_activation("pattern").shape[0] == n
    assert step0["pattern", n - 1].shape[-1] == 10                 # prompt 6 + 4 generated
    assert set(run.keys()) == {f"blocks.{l}.attn.hook_pattern" for l in range(n)}
