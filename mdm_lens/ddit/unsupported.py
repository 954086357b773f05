"""What TransformerLens offers on `HookedMDM` that the DDiT models (MDLM, Duo, BD3LM, GIDD) refuse, and why.

TL's weight processing and weight-analysis helpers assume a block whose heads read the normalised residual and
write to it unscaled, and a readout `ln_final → W_U`. A DDiT block modulates the norm by σ (`x·(1 + scale(σ)) +
shift(σ)`, per batch row) before qkv / the MLP, scales each branch by its adaLN gate(σ), and the readout is
σ-modulated too: folds, centring and the W_O / W_out / W_U products would leave σ out. These names are refused
with that reason (an `UnsupportedAttributeError`, which is an `ArgumentError` and an `AttributeError`, so `hasattr`
still answers False), as `HookedDDiT.unsupported_cache_helpers` does for TL's cache helpers; the processing flags of
`from_pretrained` are refused before any weight is read."""

from __future__ import annotations

from mdm_lens.errors import ArgumentError, UnsupportedAttributeError

_FOLD = ("the final norm and each block's norms are followed by the σ-dependent adaLN modulation "
         "(x·(1 + scale(σ)) + shift(σ), per batch row) and each branch is scaled by its adaLN gate(σ), so no fold "
         "or centring of fixed weights keeps the logits; DDiT models are always unprocessed")
_HEADS = ("TL's per-head views and their products assume heads that read the normalised residual and write to it "
          "unscaled; here the input is σ-modulated and the output is scaled by the block's adaLN gate(σ), which "
          "OV / QK / composition scores would leave out. The raw weights are blocks.{l}.attn.qkv.weight "
          "([3·d_model, d_model], rows q | k | v, head-major) and blocks.{l}.attn.out.weight")
_MLP = ("the MLP's output reaches the residual scaled by the block's adaLN gate(σ), which TL's W_in / W_out "
        "analyses leave out; the raw weights are blocks.{l}.mlp.fc_in / fc_out (GELU-tanh, no gate)")
_READOUT = ("the readout is σ-modulated (no fixed residual direction per token); use model.readout(resid, sigma) "
            "for the logits of a residual")

#: name → why a DDiT model does not offer it (every TL name HookedMDM has and HookedDDiT lacks)
UNSUPPORTED_ATTRIBUTES: dict[str, str] = {
    "process_weights_": f"TL's weight processing (fold_ln, center_unembed, fold_value_biases) is not defined: {_FOLD}",
    "untie_embeddings_": "DDiT's unembedding (output_layer.linear) is never tied to W_E: there is nothing to untie, "
                         f"and the processing it prepares is not defined ({_FOLD})",
    **dict.fromkeys(("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O", "OV", "QK", "all_composition_scores"),
                    _HEADS),
    **dict.fromkeys(("W_in", "W_out", "b_in", "b_out"), _MLP),
    "W_gate": "DDiT's MLP has no gate (fc_in → GELU-tanh → fc_out)",
    "accumulated_bias": "every branch, biases included, reaches the residual scaled by its adaLN gate(σ): the "
                        "residual has no fixed bias term",
    "tokens_to_residual_directions": _READOUT,
    "set_use_attn_result": "hook_result (each head's W_O output) would leave out the block's adaLN gate(σ); "
                           "hook_attn_out holds the gated attention output the residual receives",
    "positions": "DDiT positions are always 0..L−1 (no padding: attention_mask must be all ones)",
    "build_mask": "DDiT attends to every position (BD3LM builds its block mask inside its forward)",
}

#: from_pretrained keywords that ask for TL weight processing (ours and TL's)
PROCESSING_KEYWORDS = ("fold_ln", "center_unembed", "fold_value_biases", "center_writing_weights",
                       "refactor_factored_attn_matrices")


def refused_attribute(model_class: str, name: str) -> UnsupportedAttributeError:
    why = UNSUPPORTED_ATTRIBUTES[name]
    return UnsupportedAttributeError(
        f"model.{name} is not defined for a {model_class} model: {why}. Available here: W_E, W_U, b_U, the raw "
        "parameters (model.named_parameters()), model.readout(resid, sigma), and the hooks (run_with_cache).",
        argument=name, value=name, allowed="W_E, W_U, b_U, readout, hooks")


def refuse_processing(options: dict, family: str) -> None:
    """An ArgumentError, before any weight is read, when `from_pretrained` is asked for weight processing on a DDiT
    checkpoint (a flag set to False asks for nothing and is let through; None or 0 is not read as False)."""
    asked = [k for k in PROCESSING_KEYWORDS if k in options and options[k] is not False]
    if asked:
        raise ArgumentError(f"from_pretrained(..., {asked[0]}={options[asked[0]]!r}) on a {family} checkpoint: "
                            f"weight processing is not defined for the DDiT models: {_FOLD}. Load without it.",
                            argument=asked[0], value=options[asked[0]], allowed="False (or leave it out)")
