"""The DDiT core shared by MDLM, Duo (and BD3LM, GIDD-DiT): components, config facts, `HookedDDiT`, loaders."""

from mdm_lens.ddit.config import DDIT_FAMILIES, ddit_config  # noqa: F401
from mdm_lens.ddit.model import HookedDDiT  # noqa: F401
