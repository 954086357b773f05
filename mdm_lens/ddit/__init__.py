"""The DDiT core shared by MDLM, Duo (and BD3LM, GIDD-DiT): components, config facts, `HookedDDiT`, loaders."""

from mdm_lens.ddit.config import DDIT_FAMILIES, ddit_config  # noqa: F401
from mdm_lens.ddit.model import HookedDDiT  # noqa: F401
# the subclasses, so that HookedDDiT.from_pretrained finds the class of a BD3LM / GIDD folder (`ddit.loading.family_class`)
from mdm_lens.ddit.bd3lm import HookedBD3LM  # noqa: F401,E402
from mdm_lens.ddit.gidd import HookedGIDD  # noqa: F401,E402
