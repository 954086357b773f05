"""The keyword arguments `HookedMDM.from_pretrained` / `from_pretrained_no_processing` accept, checked up front.

A misspelt keyword (`fold_layernorm=True`) used to reach `load_pretrained` as a raw `TypeError` naming an internal
function, and a falsy non-bool processing flag (`fold_ln=None`, `fold_ln=0.0`) skipped the processing check and
loaded unprocessed without a word. Here both are typed errors naming the keyword and what is allowed.
"""

from __future__ import annotations

from typing import Any

from mdm_lens import validate


#: keywords `from_pretrained` takes (its own + those it passes to `loading.load_pretrained`)
ACCEPTED = ("dtype", "device", "allow_download", "load_tokenizer", "device_map", "max_memory", "n_devices",
            "offload_folder", "fold_ln", "center_unembed", "fold_value_biases")
PROCESSING_FLAGS = ("fold_ln", "center_unembed", "fold_value_biases")
#: TransformerLens' `from_pretrained` options that have no counterpart here (named so the error says so)
TL_UNSUPPORTED = ("center_writing_weights", "refactor_factored_attn_matrices", "hf_model", "tokenizer",
                  "torch_dtype", "move_to_device", "first_n_layers", "checkpoint_index",
                  "checkpoint_value", "default_prepend_bos", "default_padding_side", "n_ctx", "hf_cfg")


def check_pretrained_kwargs(kwargs: dict[str, Any], where: str, accepted: tuple[str, ...] = ACCEPTED) -> None:
    """Refuse keywords `where` does not take (`accepted`), naming the nearest accepted one."""
    tl = {k: "It is a TransformerLens option mdm_lens does not implement (its processing is fold_ln, "
             "center_unembed, fold_value_biases; see mdm_lens.processing)." for k in TL_UNSUPPORTED}
    # the DDiT models' loader option: say where it is taken rather than only that it is unknown here
    tl["autocast"] = ("It is the DDiT models' bf16 autocast path: HookedDDiT.from_pretrained(folder, autocast=True) "
                      "loads any MDLM / Duo / BD3LM / GIDD folder with it, or call model.set_autocast(True) after "
                      "loading.")
    validate.keywords(kwargs, accepted, where=where, notes=tl)


def processing_flags(fold_ln: Any, center_unembed: Any, fold_value_biases: Any) -> dict[str, bool]:
    """The three processing flags as bools; `None`, `0.0`, `"no"` … are refused, not read as False."""
    values = dict(fold_ln=fold_ln, center_unembed=center_unembed, fold_value_biases=fold_value_biases)
    return {k: validate.boolean(v, name=k) for k, v in values.items()}
