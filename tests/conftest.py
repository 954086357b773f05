import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

torch.set_num_threads(min(2, torch.get_num_threads()))


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
