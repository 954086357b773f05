"""Small helpers shared by the run adapters (:mod:`run`, :mod:`retrieval`, :mod:`patching`): readout shift,
layer lists, token / mask checks, the canvas of a step, and per-prompt generation. Re-exported by :mod:`run`."""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from mdm_lens.diffusion.rules import derived_steps
from mdm_lens.probes._checks import own_generate_keywords
from mdm_lens import validate
from mdm_lens.diffusion.replay import BLOCK_SAMPLERS, state_at
from mdm_lens.diffusion.window_replay import WINDOW_SAMPLERS
from mdm_lens.errors import ArgumentError, ArgumentTypeError, StepForwardError
from mdm_lens.inputs import warn_trailing_pads

from . import _checks as C

# ----------------------------------------------------------------------------------------------
# small shared helpers
# ----------------------------------------------------------------------------------------------

def is_block_diffusion(model: Any) -> bool:
    """An encoder-decoder diffusion model (DiffusionGemma through the bridge): prompt → encoder, answer → canvas."""
    return bool(getattr(model, "is_block_diffusion", False))


def require_single_stack(model: Any, probe: str, why: str) -> None:
    """A clear `InputError` where a probe cannot apply to a block-diffusion model (and says why)."""
    if is_block_diffusion(model):
        from mdm_lens.errors import InputError

        raise InputError(f"{probe} does not apply to {model.cfg.model_name} (block diffusion: prompt → encoder, "
                         f"answer → decoder canvas): {why}", argument="model", value=model.cfg.model_name,
                         allowed="a single-stack model (LLaDA, Dream, Llama, Qwen2)")


def sequence_view(model: Any, tokens: Tensor, attention_mask: Tensor | None, layers: Sequence[int],
                  prompt_length: Any, hooks: Sequence[str] = ("hook_pattern",), encoder_patterns: bool = False,
                  fwd_hooks: Sequence[Any] = ()) -> Any:
    """The whole-sequence forward of a block-diffusion model (:func:`mdm_lens.bridge.sequence.sequence_forward`)."""
    from mdm_lens.bridge.sequence import sequence_forward, split_point

    P = split_point(model, tokens, prompt_length)
    return sequence_forward(model, tokens, P, attention_mask, layers, hooks=hooks, encoder_patterns=encoder_patterns,
                            fwd_hooks=fwd_hooks)


def is_causal(model: Any) -> bool:
    return model.cfg.attention == "causal"


def readout_shift(model: Any) -> int:
    """1 if the logits for position p come from hidden state p − 1 (``logit_shift`` MDMs, causal ARMs), else 0."""
    return int(bool(model.cfg.logit_shift) or is_causal(model))


def layer_list(model: Any, layers: int | Sequence[int] | None, name: str = "layers") -> list[int]:
    """Concrete layer indices (None = all; an int, a list, a range, a slice or a 1-d int tensor; negatives
    count from the end as in Python). Out of range (``layers=[7]`` on 4 layers) or repeated layers raise
    ``OutOfRangeError`` naming the argument, the value and the valid range -- never a wrap-around."""
    return validate.indices(layers, model.cfg.n_layers, name=name, what="layer")


def _tokens(tokens: Any, name: str = "tokens", device: Any = None) -> Tensor:
    """[batch, pos] long tensor from a 1-d / 2-d integer tensor or nested int lists (non-empty)."""
    t = tokens if isinstance(tokens, Tensor) else torch.as_tensor(tokens) if isinstance(tokens, (list, tuple)) else tokens
    validate.tensor(t, name=name, ndim=(1, 2), dtype="int")
    return _batch(t, device)


def _attention_mask(mask: Any, tokens: Tensor, model: Any = None, where: str = "") -> Tensor | None:
    """The probe's `[batch, pos]` padding mask; with `model` (a user-facing entry point, not an internal forward)
    a missing mask on right-padded rows is warned about, as the forward warns about left padding."""
    if mask is None:
        if model is not None:
            warn_trailing_pads(tokens, model.cfg, where)
        return None
    m = _tokens(mask, "attention_mask", tokens.device) if not (isinstance(mask, Tensor) and mask.dtype == torch.bool) \
        else _batch(mask, tokens.device)
    if tuple(m.shape) != tuple(tokens.shape):
        raise ArgumentError(f"attention_mask has shape {tuple(m.shape)} but tokens have shape {tuple(tokens.shape)}; "
                            "they must match.", argument="attention_mask", value=mask, allowed=f"shape {tuple(tokens.shape)}")
    C.mask(m, name="attention_mask", size=tokens.shape[-1])
    return m


def _optional_length(v: Any, name: str) -> int | None:
    return C.optional_int(v, name=name, min=1)


def _nonempty(items: Any, name: str, needs: tuple[str, ...] = ()) -> list[Any]:
    """A non-empty list; with `needs`, each element must have those attributes (e.g. a zoo item's `prompt`), so a
    list of plain strings is refused here rather than failing deep inside with an AttributeError."""
    if isinstance(items, (str, bytes, Tensor)) or not isinstance(items, Sequence):
        raise ArgumentTypeError(f"{name}={validate.describe(items)} is invalid: expected a list.", argument=name,
                                value=items, allowed="a non-empty list")
    if len(items) == 0:
        raise ArgumentError(f"{name}=[] is invalid: expected at least one item.", argument=name, value=items,
                            allowed="a non-empty list")
    for i, it in enumerate(items):
        missing = [a for a in needs if not hasattr(it, a)]
        if missing:
            raise ArgumentTypeError(f"{name}[{i}]={validate.describe(it)} is not an item: it has no "
                                    f"{', '.join(missing)} (pass the items of mdm_lens.zoo.data / mdm_lens.items).",
                                    argument=f"{name}[{i}]", value=it, allowed=f"an object with {', '.join(needs)}")
    return list(items)


def _batch(tokens: Any, device: Any = None) -> Tensor:
    t = torch.as_tensor(tokens)
    t = t[None] if t.ndim == 1 else t
    return t.long() if device is None else t.long().to(device)


def step_canvas(out: Any, step: int) -> tuple[Tensor, Tensor]:
    """The model input ``x_s`` and its attention mask at ``step`` of a run (ARM: the prefix ``prompt + s``).

    Block samplers (``llada2``, ``sdar``): the canvas the step's forward covered, ``[0, query_end)``, as
    ``out.replay`` rebuilds it; run it with :func:`step_forward_kwargs` (the run's block length) so that the
    forward is the one the sampler ran, not one under the checkpoint's default block length.

    ``step`` in [-n_steps, n_steps) (negatives count from the end); out of range raises ``OutOfRangeError``."""
    from mdm_lens.diffusion.fixed_length import require_fixed_length

    require_fixed_length(out, "patching / knockout (step_canvas)", "a patched or knocked-out position would be a "
                         "different token at another step; replay a step with out.replay(model, s) instead")
    s = validate.index(step, out.n_steps, name="step", what="step")
    if getattr(out, "sampler", None) in WINDOW_SAMPLERS:
        x = out.trajectory.x_steps[s][:, :_window_step(out, s)[0]].to(out.tokens.device)
        return x, torch.ones_like(x)
    if getattr(out, "sampler", None) in BLOCK_SAMPLERS:
        state = state_at(out, s)
        end = int(state.extra["query_end"])
        x = state.x[:, :end].to(out.tokens.device)
        return x, torch.ones_like(x)  # one unpadded row; the canvas may run past the output (a block's tail)
    x = out.trajectory.x_steps[s].to(out.tokens.device)
    if out.causal:
        x = x[:, : out.prompt_length + s]
    return x, out.attention_mask[:, : x.shape[1]]


def step_forward_kwargs(out: Any, step: int | None = None) -> dict[str, Any]:
    """Keyword arguments that make ``model(step_canvas(out, s)[0], ...)`` the forward the run's sampler ran: the
    run's block length on block samplers (the model's default is the checkpoint's, which a run may override);
    with ``step``, the step's noise level σ on samplers that condition on one (MDLM / Duo: ``sigma``, from the
    sampler's ``step_time``); nothing else for the others (their forward is the plain one)."""
    if getattr(out, "sampler", None) in BLOCK_SAMPLERS:
        return {"block_length": int(out.settings["block_length"])}
    if getattr(out, "sampler", None) in WINDOW_SAMPLERS:
        if step is None:
            return {}
        s = validate.index(step, out.n_steps, name="step", what="step")
        return {"sigma": _window_step(out, s)[1].to(out.tokens.device)}
    sampler = _registered(getattr(out, "sampler", None))
    if step is not None and hasattr(sampler, "step_time"):
        s = validate.index(step, out.n_steps, name="step", what="step")
        return {"sigma": sampler.step_time(out.settings, s, out.tokens.shape[0])[1].to(out.tokens.device)}
    return {}


def _window_step(out: Any, s: int) -> tuple[int, Tensor]:
    """`(end, σ)` of BD3LM step `s` when one plain forward of the canvas `[0, end)` at σ is the forward the step
    ran (no KV cache, a window that starts at position 0); otherwise `StepForwardError` saying why. A step that ran
    no forward (it sampled again from step j's p(x0), the canvas unchanged) is step j's forward, at j's σ."""
    from mdm_lens.diffusion import window_replay

    if out.sampler != "bd3lm":
        raise StepForwardError(
            f"step {s} of this {out.sampler!r} run is a forward of one block's rows against a KV cache that an "
            "earlier causal forward filled (or that causal forward itself): the prompt reaches the block only through "
            "that cache, so patching or differentiating one forward of the canvas would test a forward the run never "
            "ran. knockout() and the step lens read the run's own forwards.", argument="out", value=out.sampler,
            allowed="a run whose step forwards are plain forwards of the canvas")
    state = window_replay.state_at(out, s)
    source = state.extra.get("reused_from")
    if source is not None:
        state = window_replay.state_at(out, source)
    if state.extra["kv_cache"]:
        raise StepForwardError(
            f"step {s} of this bd3lm run read the earlier blocks through its KV cache (kv_cache=True: keys stored at "
            "earlier steps' σ); one plain forward of the canvas is a different forward. Rerun with kv_cache=False.",
            argument="out", value="kv_cache=True", allowed="a run with kv_cache=False")
    if state.keys.start != 0:
        raise StepForwardError(
            f"step {s} of this bd3lm run forwarded the window [{state.keys.start}, {state.keys.stop}) (context_size / "
            "model_length reached), with positions restarting at 0 inside it; a forward of the canvas from position 0 "
            "is a different forward.", argument="step", value=s,
            allowed="steps whose window starts at position 0 (canvas within context_size)")
    return int(state.keys.stop), state.extra["sigma"]


def _registered(name: Any) -> Any:
    from mdm_lens.diffusion.registry import get, names

    return get(name) if name in names() else None


def noisy_canvas(model: Any, x: Tensor, prompt_length: int) -> Tensor:
    """The positions of a step's canvas that the step predicts: the mask id's, or on a model without a mask token
    (Duo, uniform-state) every generated position (each still holds resampleable noise until the run ends)."""
    from mdm_lens.noisy import noisy_positions

    return noisy_positions(model.cfg, x, prompt_length)


@torch.no_grad()
def generate_final(model: Any, prompts: Sequence[Any], gen_length: int | None = None, steps: int | None = None,
                   **generate_kwargs: Any) -> tuple[Tensor, Tensor, list[int]]:
    """Generate each prompt alone (no left padding) and right-pad the final sequences with the pad id.

    Returns ``(tokens [batch, T], attention_mask [batch, T], prompt_lengths)``; the layout the zoo twins
    were trained on (pads hidden as keys; a causal model never sees right padding).
    """
    from mdm_lens.diffusion.fixed_length import refuse_variable_sampler

    own_generate_keywords(generate_kwargs, 'generate_final')
    refuse_variable_sampler(generate_kwargs, "generate_final (floating / absorption / qk / flow of final sequences)",
                            "the final sequences would be scored with the item's fixed-length regions (prompt, "
                            "answer span), which a variable-length run moves")
    prompts = [_tokens(p, f"prompts[{i}]")[0] for i, p in enumerate(_nonempty(prompts, "prompts"))]
    g = _optional_length(gen_length, "gen_length") or int(model.cfg.extra.get("gen_length", 4))
    steps = _optional_length(steps, "steps")
    rows = []
    for p in prompts:
        out = model.generate(_batch(p, model.input_device), steps=derived_steps(steps, g), gen_length=g, **generate_kwargs)
        rows.append(out.tokens[0].cpu())
    pad = model.cfg.pad_token_id if model.cfg.pad_token_id is not None else 0
    width = max(len(r) for r in rows)
    toks = torch.full((len(rows), width), pad, dtype=torch.long)
    am = torch.zeros_like(toks)
    for i, r in enumerate(rows):
        toks[i, : len(r)], am[i, : len(r)] = r, 1
    lengths = [len(torch.as_tensor(p).flatten()) for p in prompts]
    return toks.to(model.input_device), am.to(model.input_device), lengths


