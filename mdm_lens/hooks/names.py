"""Hook-name filters as in TransformerLens (a name, a list, a predicate), plus shell globs."""

from __future__ import annotations

import fnmatch
from typing import Any

from mdm_lens.errors import HookNameError
from mdm_lens.hook_surface import is_glob


def expand_names(model: Any, names: Any) -> list[str]:
    """Concrete hook names for a name / glob / list / predicate; a filter that matches nothing is an error."""
    all_names = list(model.hook_dict)
    if not getattr(getattr(model, "cfg", None), "use_attn_result", True):
        # an opt-in hook point that is off never fires: a glob or predicate skips it, as TL's run_with_cache does
        # (a name given explicitly is still checked, and refused with what to call)
        all_names = [n for n in all_names if not n.endswith("attn.hook_result")]
    if callable(names):
        out = [n for n in all_names if names(n)]
    elif isinstance(names, str):
        if is_glob(names):
            out = fnmatch.filter(all_names, names)
        else:
            model.check_hook_name(names)
            out = [names]
    else:
        out = []
        for n in names:
            out.extend(x for x in expand_names(model, n) if x not in out)
    if not out:
        raise HookNameError(f"the hook filter {names!r} matches no hook point; see `list(model.hook_dict)`.")
    return out
