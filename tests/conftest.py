import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

torch.set_num_threads(min(2, torch.get_num_threads()))


def pytest_addoption(parser):
    parser.addoption("--device", default=None, help="device of the device-agnostic tests (tests/test_device_map.py); "
                     "default $MDM_LENS_TEST_DEVICE or cpu")


@pytest.fixture(scope="session")
def test_device(request) -> str:
    """The accelerator the device-agnostic tests place models on (`--device cuda:0`); 'cpu' by default."""
    return request.config.getoption("--device") or os.environ.get("MDM_LENS_TEST_DEVICE", "cpu")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def mdm():
    """The shipped tiny MDM twin (sweep tests)."""
    from mdm_lens import HookedMDM

    return HookedMDM.from_pretrained("mdm-lens/tiny-mdm")


@pytest.fixture(scope="module")
def arm():
    """The shipped tiny ARM twin (sweep tests)."""
    from mdm_lens import HookedMDM

    return HookedMDM.from_pretrained("mdm-lens/tiny-arm")


@pytest.fixture
def twins(tmp_path, monkeypatch):
    """Random stand-ins for the demo's twins (tiny, realistic weights), saved and put in place of the shipped ones."""
    import mdm_lens.demo as demo
    from mdm_lens import HookedMDM, MDMConfig
    from mdm_lens.loading import save_pretrained
    from mdm_lens.zoo import tokenizer as ZT

    names = {}
    for kind, attention in (("MDM", "bidirectional"), ("ARM", "causal")):
        cfg = MDMConfig(d_model=32, n_layers=2, n_heads=2, d_mlp=64, d_vocab=ZT.vocab_size(), n_ctx=128,
                        attention=attention, mask_token_id=ZT.MASK_ID, bos_token_id=ZT.BOS_ID,
                        eos_token_id=ZT.EOS_ID, pad_token_id=ZT.PAD_ID, family="mdm_lens",
                        model_name=f"stand-in-{kind.lower()}", extra={"gen_length": 4, "prepend_bos": False})
        model = HookedMDM.from_config(cfg, seed=0, init_std=0.2, tokenizer=ZT.load_tokenizer())
        names[kind] = str(save_pretrained(model, tmp_path / kind))
    monkeypatch.setattr(demo, "TWINS", names)
    return names
