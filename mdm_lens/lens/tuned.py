"""A tuned lens for masked diffusion LMs: per layer one affine translator `h -> h + A h + b` (A = 0, b = 0 at
start, so an untrained lens is exactly the logit lens), followed by the model's final norm and unembedding.

    lens = train_tuned_lens(model, clean_tokens, n_steps=300, seed=0)     # masked canvases, KL to the final logits
    masked_kl(model, held_out, lens=lens)                                 # [layer] mean KL on masked positions
    lens.save("lens/"); TunedLens.load("lens/", model)                    # refuses another model (strict=False: allow)
    lens_trace(model, out, lens=lens)                                     # the tuned lens over denoising steps

Training data are the activations a diffusion LM computes: clean sequences masked by LLaDA's forward process
(`mdm_lens.sae.MaskedCanvas`: per row t ~ U(0, 1), each maskable token masked with prob (1 - eps) t + eps, or a
fixed `mask_rate`). The objective is the standard tuned-lens one, KL(final || lens) of the position-aligned
distributions, here averaged over the masked positions (the ones the model is trained to predict). The model
is frozen: gradients are taken with respect to the translators only. Runs are deterministic given `seed`.

A lens belongs to one model: it records the model's identity (`model_identity`: cfg name, family, shapes and a
fingerprint of 32 values of every parameter) and refuses another model, even one of the same shapes (a lens of
one checkpoint is silently wrong on another), unless loaded with ``strict=False``. A lens with a NaN/inf
parameter (a diverged fit, a damaged file) is refused at load, at the end of training and before every use: it
would turn every lens probability into NaN.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn

from mdm_lens import validate
from mdm_lens.errors import (ArgumentTypeError, CheckpointNotFoundError, InputError, NonFiniteError,
                             OutOfRangeError)
from mdm_lens.inputs import warn_trailing_pads
from mdm_lens.lens.logit import _readout, check_model, resid_name

__all__ = ["TunedLens", "train_tuned_lens", "masked_kl", "model_identity"]

WEIGHTS, CONFIG = "tuned_lens.safetensors", "tuned_lens.json"
_PROBE = 16  # values read from each parameter for the fingerprint


def model_identity(model: Any) -> dict[str, Any]:
    """What a tuned lens is bound to: cfg name, family and shapes, and a SHA-256 fingerprint of the first
    `_PROBE` values and `_PROBE` evenly strided values of every parameter (names included), rounded through
    bfloat16 so one checkpoint loaded in float32 or bfloat16 gives the same fingerprint while another checkpoint
    (or TL-style weight processing, which changes the residual stream the lens reads) does not. A change that
    touches none of the sampled values (e.g. a fine-tune of a few rows) can go unnoticed: the check is a guard
    against the wrong checkpoint, not a proof of the right one."""
    c = model.cfg
    digest = hashlib.sha256()
    for name, p in model.named_parameters():
        if p.device.type == "meta":  # offloaded and not materialised: its name and shape still count
            digest.update(f"{name}{tuple(p.shape)}".encode())
            continue
        flat = p.detach().reshape(-1)
        probe = torch.cat([flat[:_PROBE], flat[::max(1, flat.numel() // _PROBE)][:_PROBE]])  # head + a stride
        digest.update(name.encode() + probe.to("cpu", torch.bfloat16).float().numpy().tobytes())
    return {"model_name": c.model_name, "family": c.family, "d_model": c.d_model, "n_layers": c.n_layers,
            "d_vocab": c.d_vocab, "fingerprint": digest.hexdigest()[:16]}


class TunedLens(nn.Module):
    """Affine translators for some layers of one model: `translate(resid, layer) = resid + resid A_l^T + b_l`."""

    def __init__(self, d_model: int, n_layers: int, layers: Any = None, *, model_name: str = ""):
        super().__init__()
        self.d_model = validate.integer(d_model, name="d_model", min=1)
        self.n_layers = validate.integer(n_layers, name="n_layers", min=1)
        self.layers = validate.indices(layers, n_layers, name="layers", what="layer")
        self.model_name = model_name
        self.delta = nn.ParameterList(nn.Parameter(torch.zeros(d_model, d_model)) for _ in self.layers)
        self.bias = nn.ParameterList(nn.Parameter(torch.zeros(d_model)) for _ in self.layers)
        self.training_info: dict[str, Any] = {}
        self.model_identity: dict[str, Any] | None = None  # set by identity() / load(); None: not bound
        self.strict = True

    @classmethod
    def identity(cls, model: Any, layers: Any = None) -> "TunedLens":
        """An untrained lens (A = 0, b = 0): the logit lens, translator for translator; bound to `model`."""
        check_model(model)
        lens = cls(model.cfg.d_model, model.cfg.n_layers, layers, model_name=model.cfg.model_name)
        lens.model_identity = model_identity(model)
        return lens.to(model.input_device)

    def _slot(self, layer: int) -> int:
        return self.layers.index(self.check_layer(layer))

    def check_layer(self, layer: Any) -> int:
        layer = validate.index(layer, self.n_layers, name="layer", what="layer")
        if layer not in self.layers:
            raise OutOfRangeError(f"layer={layer} has no translator in this tuned lens (layers {self.layers}).",
                                  argument="layer", value=layer, allowed=f"one of {self.layers}")
        return layer

    def check_model(self, model: Any) -> None:
        """Refuse a model of other shapes always, and (``self.strict``) any model but the one the lens was made
        for; refuse NaN/inf parameters."""
        c = model.cfg
        if (c.d_model, c.n_layers) != (self.d_model, self.n_layers):
            raise InputError(f"this tuned lens is for d_model={self.d_model}, {self.n_layers} layers "
                             f"({self.model_name!r}); the model has d_model={c.d_model}, {c.n_layers} layers.",
                             argument="lens", value=self.model_name, allowed=f"a lens trained on {c.model_name!r}")
        if self.strict and self.model_identity is not None:
            have = model_identity(model)
            diff = {k: (v, have.get(k)) for k, v in self.model_identity.items() if have.get(k) != v}
            if diff:
                raise InputError(f"this tuned lens was made for another model ({diff}: lens's vs this model's). A "
                                 "lens of one checkpoint is wrong on another of the same shapes; train one for "
                                 "this model, or load with TunedLens.load(..., strict=False) to use it anyway.",
                                 argument="lens", value=self.model_identity, allowed=f"a lens made for {have}")
        self.check_finite()

    def check_finite(self) -> None:
        """NaN/inf in a translator makes every lens probability NaN: refuse, naming the layer."""
        for i, l in enumerate(self.layers):
            for kind, p in (("delta", self.delta[i]), ("bias", self.bias[i])):
                if not bool(torch.isfinite(p.detach()).all()):
                    raise NonFiniteError(f"the tuned lens' {kind}.{l} holds {int(torch.isnan(p).sum())} NaN and "
                                         f"{int(torch.isinf(p).sum())} inf values (a diverged fit or a damaged "
                                         "file); retrain it (e.g. a smaller lr).", argument=f"lens.{kind}.{l}",
                                         value=validate.describe(p), allowed="finite values")

    def translate(self, resid: Float[Tensor, "... d_model"], layer: int) -> Float[Tensor, "... d_model"]:
        i = self._slot(layer)
        validate.tensor(resid, name="resid", dtype="float")
        if resid.shape[-1] != self.d_model:
            raise InputError(f"resid has width {resid.shape[-1]}; this lens translates d_model={self.d_model}.",
                             argument="resid", value=validate.describe(resid), allowed=f"[..., {self.d_model}]")
        if not bool(torch.isfinite(self.delta[i].detach()).all() & torch.isfinite(self.bias[i].detach()).all()):
            self.check_finite()
        x = resid.float()
        return (x + F.linear(x, self.delta[i], self.bias[i])).to(resid.dtype)

    # --- files ---------------------------------------------------------------------------------------
    def config(self) -> dict[str, Any]:
        return {"format": "mdm_lens.tuned_lens", "version": 1, "model_name": self.model_name,
                "model_identity": self.model_identity,
                "d_model": self.d_model, "n_layers": self.n_layers, "layers": self.layers,
                "training": {k: ([None if isinstance(x, float) and math.isnan(x) else x for x in v]
                                 if k == "loss" else v) for k, v in self.training_info.items()}}

    def save(self, folder: str | Path) -> Path:
        """Write `tuned_lens.safetensors` (delta.{layer}, bias.{layer}, float32) and `tuned_lens.json`."""
        from safetensors.torch import save_file

        folder = validate.output_folder(folder, name="folder")
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for i, l in enumerate(self.layers):
            tensors[f"delta.{l}"] = self.delta[i].detach().cpu().contiguous()
            tensors[f"bias.{l}"] = self.bias[i].detach().cpu().contiguous()
        save_file(tensors, str(folder / WEIGHTS))
        (folder / CONFIG).write_text(json.dumps(self.config(), indent=1))
        return folder

    @classmethod
    def load(cls, folder: str | Path, model: Any = None, *, strict: bool = True) -> "TunedLens":
        """Read a saved lens (checked against `model` and moved to its device when given). `strict=False` lets
        it run on a model other than the one it was saved for (same shapes still required), now and later."""
        from safetensors.torch import load_file

        folder = Path(folder)
        if not (folder / WEIGHTS).is_file() or not (folder / CONFIG).is_file():
            raise CheckpointNotFoundError(f"{folder} has no {WEIGHTS} + {CONFIG} (written by TunedLens.save).")
        bad = dict(argument="folder", value=str(folder), allowed="a folder written by TunedLens.save")
        try:
            cfg = json.loads((folder / CONFIG).read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:  # e.g. a copy cut short: name the file
            raise InputError(f"{folder / CONFIG} is not valid JSON ({type(e).__name__}: {e}); save the lens "
                             "again.", **bad) from None
        keys = ("d_model", "n_layers", "layers", "model_name")
        if not isinstance(cfg, dict) or cfg.get("format") != "mdm_lens.tuned_lens" or any(k not in cfg for k in keys):
            raise InputError(f"{folder / CONFIG} is not a tuned-lens config (it needs format "
                             f"'mdm_lens.tuned_lens' and {', '.join(keys)}).", **bad)
        lens = cls(cfg["d_model"], cfg["n_layers"], cfg["layers"], model_name=cfg["model_name"])
        lens.training_info = dict(cfg.get("training", {}))
        lens.model_identity = cfg.get("model_identity")  # absent in files written before identities were saved
        lens.strict = validate.boolean(strict, name="strict")
        if "loss" in lens.training_info:  # NaN (a batch with no masked position) is stored as null
            lens.training_info["loss"] = [math.nan if x is None else x for x in lens.training_info["loss"]]
        try:
            tensors = load_file(str(folder / WEIGHTS))
        except Exception as e:  # safetensors' errors share no public base class: a truncated or foreign file
            raise InputError(f"{folder / WEIGHTS} is not a readable safetensors file ({type(e).__name__}: "
                             f"{str(e).splitlines()[0][:200]}); save the lens again.", **bad) from None
        want = {f"{k}.{l}" for l in lens.layers for k in ("delta", "bias")}
        if set(tensors) != want:
            raise InputError(f"{folder / WEIGHTS} holds {sorted(tensors)}, expected {sorted(want)}.", **bad)
        with torch.no_grad():
            for i, l in enumerate(lens.layers):
                for name, param in ((f"delta.{l}", lens.delta[i]), (f"bias.{l}", lens.bias[i])):
                    if tuple(tensors[name].shape) != tuple(param.shape):  # copy_ would broadcast or raise raw
                        raise InputError(f"{folder / WEIGHTS}: {name} has shape {tuple(tensors[name].shape)}, "
                                         f"expected {tuple(param.shape)} (d_model {lens.d_model}).", **bad)
                    param.copy_(tensors[name])
        lens.check_finite()
        if model is not None:
            check_model(model)
            lens.check_model(model)
            lens = lens.to(model.input_device)
        return lens

    def __repr__(self) -> str:
        trained = self.training_info.get("n_steps", 0)
        return (f"TunedLens({self.model_name!r}, layers={self.layers}, d_model={self.d_model}, "
                f"{'trained ' + str(trained) + ' steps' if trained else 'untrained (= logit lens)'})")


# --- data ---------------------------------------------------------------------------------------------

def _check_tokens(model: Any, tokens: Any, attention_mask: Any, where: str) -> tuple[Tensor, Tensor | None]:
    tokens = validate.tensor(tokens, name="tokens", ndim=2, dtype="int")
    if int(tokens.min()) < 0 or int(tokens.max()) >= model.cfg.d_vocab:
        raise InputError(f"tokens hold ids outside [0, {model.cfg.d_vocab}).", argument="tokens",
                         value=validate.describe(tokens), allowed=f"ids in [0, {model.cfg.d_vocab})")
    if attention_mask is not None:
        validate.tensor(attention_mask, name="attention_mask", shape=tuple(tokens.shape), dtype=("int", "bool"))
    else:
        warn_trailing_pads(tokens, model.cfg, where)
    return tokens, attention_mask


def _canvas(model: Any, mask_rate: Any, seed: int) -> Any:
    from mdm_lens.sae.canvas import MaskedCanvas

    return MaskedCanvas(model, mask_rate=mask_rate, positions="all", seed=seed)


def source_rows(masked: Tensor, shift: bool) -> tuple[Tensor, Tensor]:
    """(row, position) indices of the residual rows whose raw logits are the aligned predictions at the `masked`
    positions, in `masked`'s row-major order: the same positions, or (Dream's shift) the one before (position 0
    reads itself, as in `shift_logits`)."""
    b, i = masked.nonzero(as_tuple=True)
    return b, (i - 1).clamp(min=0) if shift else i


def _layer_kl(model: Any, lens: Any, resid: Tensor, layer: int, target_logp: Tensor, src: tuple[Tensor, Tensor]
              ) -> Tensor:
    """Mean over the masked positions of KL(final || lens) at one layer (a 0-d tensor); only the residual rows
    that predict masked positions (`src`) go through the final norm and unembedding."""
    logq = _readout(model, resid[src], layer, lens).float().log_softmax(-1)
    p = target_logp.exp()
    return (p * (target_logp - logq)).sum(-1).mean()


def _forward(model: Any, noisy: Tensor, am: Tensor | None, layers: list[int]) -> tuple[Tensor, dict[str, Tensor]]:
    names = [resid_name(l) for l in layers]
    with torch.no_grad():
        logits, cache = model.run_with_cache(noisy, attention_mask=am, names_filter=names, return_type="aligned")
    return logits, {n: cache[n] for n in names}


def masked_kl(model: Any, tokens: Any, *, lens: TunedLens | None = None, attention_mask: Any = None,
              layers: Any = None, mask_rate: float | None = None, seed: int = 0, batch_size: int = 32
              ) -> Float[Tensor, "layer"]:
    """Mean KL(final || lens) per layer over all masked positions of `tokens` (masked by the forward process,
    drawn from `seed`, so two lenses evaluated with one seed see the same canvases). `lens=None`: the logit lens.
    Float64 `[len(layers)]`; all NaN when no position was masked (a mean over nothing is undefined)."""
    check_model(model)
    tokens, attention_mask = _check_tokens(model, tokens, attention_mask, "masked_kl")
    layers = validate.indices(layers, model.cfg.n_layers, name="layers", what="layer")
    if lens is not None:
        if not isinstance(lens, TunedLens):
            raise ArgumentTypeError(f"lens={validate.describe(lens)} is not a TunedLens.", argument="lens",
                                    value=lens, allowed="None or a TunedLens")
        lens.check_model(model)
        for l in layers:
            lens.check_layer(l)
    batch_size = validate.integer(batch_size, name="batch_size", min=1)
    canvas = _canvas(model, mask_rate, validate.seed(seed, min=None))
    total, count = torch.zeros(len(layers), dtype=torch.float64), 0
    dev = model.input_device
    for i in range(0, tokens.shape[0], batch_size):
        am = None if attention_mask is None else attention_mask[i:i + batch_size].to(dev)
        noisy, masked = canvas.mask(tokens[i:i + batch_size].to(dev))
        n = int(masked.sum())
        if n == 0:
            continue
        logits, cache = _forward(model, noisy, am, layers)
        target = logits[masked].float().log_softmax(-1)
        src = source_rows(masked, model.cfg.logit_shift)
        with torch.no_grad():
            for j, l in enumerate(layers):
                total[j] += float(_layer_kl(model, lens, cache[resid_name(l)], l, target, src)) * n
        count += n
    if count:
        return total / count
    import warnings  # the NaN's reason: a mean over no position, not a diverged lens

    warnings.warn(f"masked_kl: no position of the {tokens.shape[0]} row(s) was masked (rows too short or all "
                  "BOS / padding, or a low mask_rate with this seed), so the mean KL is undefined: NaN for every "
                  "layer. Give longer rows or a higher mask_rate.", UserWarning, stacklevel=2)
    return torch.full((len(layers),), float("nan"), dtype=torch.float64)


def train_tuned_lens(model: Any, tokens: Any, *, attention_mask: Any = None, layers: Any = None, n_steps: int = 300,
                     batch_size: int = 16, lr: float = 1e-3, mask_rate: float | None = None, seed: int = 0
                     ) -> TunedLens:
    """Train one translator per layer of `layers` (default: all but the last, whose translator stays the identity:
    its lens is the model's output) (Adam, `lr`) on masked canvases of `tokens` `[n, pos]` (clean sequences;
    `attention_mask` marks padding, which is never masked): each step draws `batch_size` rows and their masks from
    `seed` and lowers Σ_layers mean-over-masked-positions KL(final || lens). The frozen model's parameters get no
    gradient. `lens.training_info["loss"]` is the per-step mean KL over layers (NaN for a batch with no masked
    position, which is skipped)."""
    check_model(model)
    tokens, attention_mask = _check_tokens(model, tokens, attention_mask, "train_tuned_lens")
    n_steps = validate.integer(n_steps, name="n_steps", min=1)
    batch_size = validate.integer(batch_size, name="batch_size", min=1)
    lr = validate.number(lr, name="lr", min=0.0, min_open=True)
    seed = validate.seed(seed, min=None)
    n = model.cfg.n_layers
    trained = validate.indices(layers, n, name="layers", what="layer") if layers is not None else list(range(n - 1))
    if not trained:  # a 1-layer model: its only layer is the output
        raise InputError("a 1-layer model has no layer before the output to tune.", argument="layers", value=layers,
                         allowed="layers below the last")
    # the last layer's lens is the model's output: its translator stays the identity (a tiny non-zero gradient
    # from rounding would otherwise be blown up by Adam's normalisation)
    lens = TunedLens.identity(model, sorted(set(trained) | {n - 1}))
    params = [p for i, l in enumerate(lens.layers) if l in trained and l != n - 1 for p in (lens.delta[i], lens.bias[i])]
    trained = [l for l in lens.layers if l in trained and l != n - 1]
    if not params:
        raise InputError(f"layers={layers} names only the last layer, whose lens is the model's output.",
                         argument="layers", value=layers, allowed="layers below the last")
    opt = torch.optim.Adam(params, lr=lr)
    canvas = _canvas(model, mask_rate, seed)
    order = torch.Generator().manual_seed((seed + 1) % 2**64)  # batch draws, separate from the masks' generator
    dev = model.input_device
    history: list[float] = []
    for _ in range(n_steps):
        rows = torch.randint(tokens.shape[0], (batch_size,), generator=order)
        am = None if attention_mask is None else attention_mask[rows].to(dev)
        noisy, masked = canvas.mask(tokens[rows].to(dev))
        if not bool(masked.any()):
            history.append(math.nan)
            continue
        logits, cache = _forward(model, noisy, am, trained)
        target = logits[masked].float().log_softmax(-1)
        src = source_rows(masked, model.cfg.logit_shift)
        loss = sum(_layer_kl(model, lens, cache[resid_name(l)], l, target, src) for l in trained)
        grads = torch.autograd.grad(loss, params)  # the translators only: the model's weights get no .grad
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        opt.zero_grad(set_to_none=True)
        history.append(loss.item() / len(trained))
    lens.check_finite()  # a diverged fit: refuse it here rather than hand back NaN probabilities
    lens.training_info = {"n_steps": n_steps, "trained_layers": trained, "batch_size": batch_size, "lr": lr, "seed": seed,
                          "mask_rate": mask_rate, "objective": "mean KL(final || lens) on masked positions",
                          "n_sequences": int(tokens.shape[0]), "loss": history}
    return lens
