"""Train the zoo twins: a tiny masked diffusion LM (``mdm-lens/tiny-mdm``) and its autoregressive twin
(``mdm-lens/tiny-arm``), same architecture, same tokenizer, same data stream; only the attention
(bidirectional vs causal) and the objective differ.

Run ``python -m mdm_lens.zoo.train [--which mdm|arm|both] [--minutes N] [--steps S] [--out DIR]``.
The defaults reproduce the shipped weights (see ``mdm_lens/zoo/README.md``); ``--out`` defaults to
``mdm_lens/zoo/assets``, which holds ``tiny-mdm/``, ``tiny-arm/``, ``training_log_{mdm,arm}.json``,
``results.json`` and ``training_curves.png``.

Data: ``data.training_items`` (fresh random facts per item, 0..k distractors, random gold position,
10% closed-book), with a curriculum: k ramps linearly from 0 to 4 over the first 40% of training
(``curriculum=0.4``), then stays at 4.
Each sequence is ``prompt ids + [answer, <eos>, <eos>, <eos>]``: a fixed answer canvas of ``gen_length`` (G=4) tokens whose unused slots are ``<eos>`` (LLaDA's SFT convention).
Batches are length-bucketed, right-padded with ``<pad>`` and come with an attention mask that hides
pads as keys. Both twins see the same batches in the same order (``data_seed``).

Objectives, per sequence, with a share ``sft_frac`` (0.9) of "SFT" rows and the rest "pretraining" rows:

* MDM (LLaDA): SFT rows mask only the G canvas slots (the prompt is never masked); pretraining rows
  may mask every non-pad token but ``<bos>``. Masked tokens become ``<mask>`` (id 3). Default masking
  (``mask_schedule="count"``): l ~ U{1..L} over the row's L maskable positions, exactly l of them
  masked, each masked CE weighted L/l -- the equivalent lower-variance form of LLaDA's NELBO (the
  paper's alternative to t ~ U(0,1), p = (1-1e-3)t + 1e-3, weight 1/p, which is
  ``mask_schedule="continuous"``). Row loss = Σ_masked weight·CE / L (SFT: ÷ answer-canvas length;
  pretraining: ÷ sequence length, as in LLaDA's guidelines), so with "count" it is the mean CE over
  the masked tokens; batch loss = mean over rows.
* ARM: next-token CE; SFT rows score only the G canvas targets (answer + eos), pretraining rows every
  target of the sequence; row loss = mean CE over its scored targets; batch loss = mean over rows.
  So the twins weight prompt vs answer identically; no extra answer weight.

Optimiser: AdamW (lr 1e-3, batch 32, β = 0.9, 0.95; weight decay 0.1 on matrices and embeddings, none
on norm weights), linear warmup then cosine decay to 10% of the peak lr, grad-norm clip 1.0. At lr 3e-3
the MDM stayed at closed-book chance for thousands of steps while the ARM learned; at 1e-3 both learn
(see the zoo README's "How we got here"). Training stops at the step
budget or the wall-time budget, whichever comes first (logged as ``stopped_by``). The cosine's
progress is max(step fraction, elapsed-time fraction), so the lr anneals fully under either budget; a
run stopped by steps is bit-reproducible from its seeds, a time-bound one depends on machine speed.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from mdm_lens.model import HookedMDM
from mdm_lens.zoo import data as D  # noqa: F401
from mdm_lens.zoo import tokenizer as T  # noqa: F401
# Configs and the data stream live in `recipe` / `batches` (evaluation needs them without training); re-exported.
from mdm_lens.zoo.batches import Batch, batch_stream, collate, encode_training_item, max_distractors_at  # noqa: F401
from mdm_lens.zoo.recipe import (ASSETS, EPS, NAMES, ArchConfig, Objective, TrainConfig,  # noqa: F401
                                 model_config)


# --- objectives ------------------------------------------------------------------------------------

def _regimes(b: Batch, tc: TrainConfig, gen: torch.Generator) -> torch.Tensor:
    """[batch] bool: True = SFT row (canvas-only), False = pretraining row (whole sequence)."""
    return torch.rand(b.ids.shape[0], generator=gen) < tc.sft_frac


def _regions(b: Batch, sft: torch.Tensor, gen_length: int) -> torch.Tensor:
    """[batch, width] bool: the positions a row's loss is about (canvas for SFT rows, all but <bos>
    and pads for pretraining rows)."""
    pos = torch.arange(b.ids.shape[1])[None]
    canvas = (pos >= b.starts[:, None]) & (pos < (b.starts + gen_length)[:, None])
    whole = (pos >= 1) & b.attention_mask.bool()
    return torch.where(sft[:, None], canvas, whole)


def mdm_masks(region: torch.Tensor, tc: TrainConfig, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Which positions to mask ``[batch, width]`` and each masked token's ELBO weight ``[batch]``
    (per row; the row loss is ``Σ_masked weight · CE / |region|``).

    * ``"count"`` (default): l ~ U{1..L} with L = |region|, mask l region positions uniformly without
      replacement, weight L/l. LLaDA's equivalent, lower-variance form of its NELBO (always ≥ 1 mask).
    * ``"continuous"``: t ~ U(0,1), p = (1-ε)t + ε, mask each region position i.i.d. with prob p,
      weight 1/p. Rows that draw no mask contribute zero (no forcing, which would bias the estimate).
    """
    bsz, width = region.shape
    L = region.sum(1)
    if tc.mask_schedule == "count":
        l = (torch.rand(bsz, generator=gen) * L).floor().long().clamp(max=L - 1) + 1
        score = torch.rand(bsz, width, generator=gen).masked_fill(~region, 2.0)
        rank = score.argsort(1).argsort(1)  # 0 = first chosen; non-region positions rank last
        return rank < l[:, None], L / l
    if tc.mask_schedule == "continuous":
        p = (1 - EPS) * torch.rand(bsz, generator=gen) + EPS
        return (torch.rand(bsz, width, generator=gen) < p[:, None]) & region, 1.0 / p
    raise ValueError(f"mask_schedule must be 'count' or 'continuous', got {tc.mask_schedule!r}")


def mdm_loss(model: HookedMDM, b: Batch, tc: TrainConfig, gen: torch.Generator) -> tuple[torch.Tensor, dict]:
    """LLaDA's masked-diffusion loss on one batch (see module doc)."""
    bsz, width = b.ids.shape
    sft = _regimes(b, tc, gen)
    region = _regions(b, sft, tc.gen_length)
    masked, weight = mdm_masks(region, tc, gen)
    noisy = b.ids.masked_fill(masked, model.cfg.mask_token_id)
    logits = model(noisy, attention_mask=b.attention_mask)
    ce = F.cross_entropy(logits[masked].float(), b.ids[masked], reduction="none")  # [n_masked]
    row = masked.nonzero()[:, 0]
    weighted = torch.zeros(bsz).index_add_(0, row, ce * weight[row])
    loss = (weighted / region.sum(1)).mean()
    with torch.no_grad():
        ans = masked & (torch.arange(width)[None] == b.starts[:, None])  # masked answer tokens
        stats = {"masked_ce": ce.mean().item() if ce.numel() else float("nan"),
                 "answer_ce": F.cross_entropy(logits[ans].float(), b.ids[ans]).item() if ans.any() else float("nan")}
    return loss, stats


def arm_loss(model: HookedMDM, b: Batch, tc: TrainConfig, gen: torch.Generator) -> tuple[torch.Tensor, dict]:
    """Next-token CE, canvas-only for SFT rows and whole-sequence for pretraining rows (see module doc)."""
    bsz, width = b.ids.shape
    sft = _regimes(b, tc, gen)
    region = _regions(b, sft, tc.gen_length)  # scored target positions (never position 0)
    logits = model(b.ids)  # causal: right padding is invisible to real positions
    pred = logits[:, :-1]  # hidden i predicts token i+1
    tgt_region = region[:, 1:]
    ce = F.cross_entropy(pred[tgt_region].float(), b.ids[:, 1:][tgt_region], reduction="none")
    row = tgt_region.nonzero()[:, 0]
    summed = torch.zeros(bsz).index_add_(0, row, ce)
    loss = (summed / tgt_region.sum(1)).mean()
    with torch.no_grad():
        ans = torch.arange(width - 1)[None] == (b.starts - 1)[:, None]
        stats = {"token_ce": ce.mean().item(), "answer_ce": F.cross_entropy(pred[ans].float(), b.ids[:, 1:][ans]).item()}
    return loss, stats


# --- training loop ---------------------------------------------------------------------------------

def lr_at(step: int, tc: TrainConfig, time_frac: float = 0.0) -> float:
    """Warmup then cosine; progress is the larger of the step fraction and the time-budget fraction,
    so the lr anneals fully whichever budget binds."""
    if step < tc.warmup:
        return tc.lr * (step + 1) / tc.warmup
    frac = min(1.0, max((step - tc.warmup) / max(1, tc.steps - tc.warmup), time_frac))
    return tc.lr * (tc.min_lr_frac + (1 - tc.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac)))


def _optimizer(model: HookedMDM, tc: TrainConfig) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": tc.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=tc.lr, betas=tc.betas)


def train(tc: TrainConfig, arch: ArchConfig | None = None) -> tuple[HookedMDM, dict[str, Any]]:
    """Train one twin; returns the model (eval mode) and its log (config, history, stop reason)."""
    from mdm_lens.zoo.evaluate import accuracy

    torch.set_num_threads(tc.threads)
    torch.manual_seed(tc.seed)
    arch = arch or ArchConfig()
    recipe = {k: v for k, v in asdict(tc).items() if k not in ("verbose", "val_every", "val_n", "val_seed",
                                                                  "log_every", "threads")}
    cfg = model_config(tc.objective, arch, tc.gen_length, recipe)
    model = HookedMDM.from_config(cfg, seed=tc.seed, init_std=arch.init_std, tokenizer=T.load_tokenizer())
    model.train()
    opt = _optimizer(model, tc)
    gen = torch.Generator().manual_seed(tc.seed + 1)
    loss_fn = mdm_loss if tc.objective == "mdm" else arm_loss
    val_items = D.make_dataset(tc.val_n, seed=tc.val_seed, n_distractors=4)
    history: list[dict[str, float]] = []
    val: list[dict[str, float]] = []
    acc_loss: list[float] = []
    acc_stats: dict[str, list[float]] = {}
    t0 = time.perf_counter()
    budget = tc.minutes * 60.0
    stopped_by = "steps"
    step = 0
    def progress() -> float:  # the same clock as the lr schedule
        return max(step / max(1, tc.steps), (time.perf_counter() - t0) / budget if budget > 0 else 1.0)

    stream = batch_stream(tc, progress)
    for step in range(tc.steps):
        if time.perf_counter() - t0 >= budget:
            stopped_by = "time"
            break
        lr = lr_at(step, tc, (time.perf_counter() - t0) / budget if budget > 0 else 1.0)
        for g in opt.param_groups:
            g["lr"] = lr
        b = next(stream)
        loss, stats = loss_fn(model, b, tc, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        opt.step()
        acc_loss.append(loss.item())
        for k, v in {**stats, "grad_norm": gnorm.item()}.items():
            acc_stats.setdefault(k, []).append(v)
        if (step + 1) % tc.log_every == 0 or step == tc.steps - 1:
            entry = {"step": step + 1, "max_distractors": max_distractors_at(progress(), tc), "time_s": round(time.perf_counter() - t0, 2), "lr": lr,
                     "loss": sum(acc_loss) / len(acc_loss)}
            for k, vs in acc_stats.items():
                vs = [v for v in vs if v == v]
                entry[k] = sum(vs) / len(vs) if vs else float("nan")
            history.append({k: (round(v, 5) if isinstance(v, float) else v) for k, v in entry.items()})
            acc_loss, acc_stats = [], {}
            if tc.verbose:
                print(json.dumps(history[-1]), flush=True)
        if tc.val_every and ((step + 1) % tc.val_every == 0):
            acc = accuracy(model, val_items, tc.gen_length)
            model.train()
            val.append({"step": step + 1, "time_s": round(time.perf_counter() - t0, 2),
                        "exact_match": acc["exact_match"], "substring_match": acc["substring_match"]})
            if tc.verbose:
                print(json.dumps({"val": val[-1]}), flush=True)
    else:
        step = tc.steps
    n_done = step if stopped_by == "time" else tc.steps
    wall = time.perf_counter() - t0
    model.eval()
    model.cfg.extra["recipe"]["steps_done"] = n_done
    model.cfg.extra["recipe"]["stopped_by"] = stopped_by
    model.cfg.extra["recipe"]["wall_s"] = round(wall, 1)
    log = {"objective": tc.objective, "model_name": cfg.model_name, "train_config": asdict(tc),
           "arch": asdict(arch), "n_params": sum(p.numel() for p in model.parameters()),
           "steps_done": n_done, "stopped_by": stopped_by, "wall_s": round(wall, 1),
           "history": history, "val": val}
    if tc.verbose:
        print(f"[{tc.objective}] stopped by {stopped_by} after {n_done} steps, {wall:.0f} s", flush=True)
    return model, log


def train_mdm(**overrides: Any) -> tuple[HookedMDM, dict[str, Any]]:
    """`train` with the MDM objective; keyword overrides of `TrainConfig` (and `arch=ArchConfig(...)`)."""
    arch = overrides.pop("arch", None)
    return train(TrainConfig(objective="mdm", **overrides), arch)


def train_arm(**overrides: Any) -> tuple[HookedMDM, dict[str, Any]]:
    """`train` with the autoregressive objective (same overrides as `train_mdm`)."""
    arch = overrides.pop("arch", None)
    return train(TrainConfig(objective="arm", **overrides), arch)


# --- saving, plotting, CLI -------------------------------------------------------------------------

def save_twin(model: HookedMDM, folder: Path, storage_dtype: torch.dtype = torch.float16) -> Path:
    """`save_pretrained`, with weights stored in ``storage_dtype`` (fp16 halves the shipped size; the
    loader casts to the requested dtype, fp32 by default)."""
    import copy

    from mdm_lens.loading import save_pretrained

    tok, model.tokenizer = model.tokenizer, None
    try:
        m = copy.deepcopy(model).to(storage_dtype)
    finally:
        model.tokenizer = tok
    m.cfg.dtype = storage_dtype
    m.tokenizer = T.load_tokenizer()
    return save_pretrained(m, folder)


def plot_curves(out: Path) -> Path | None:
    """``training_curves.png`` from whichever ``training_log_*.json`` exist in ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    logs = {o: json.loads((out / f"training_log_{o}.json").read_text()) for o in ("mdm", "arm")
            if (out / f"training_log_{o}.json").exists()}
    if not logs:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    colours = {"mdm": "tab:blue", "arm": "tab:orange"}
    for o, log in logs.items():
        h = log["history"]
        steps = [e["step"] for e in h]
        axes[0].plot(steps, [e["loss"] for e in h], color=colours[o], label=f"{o} training loss")
        axes[1].plot(steps, [e["answer_ce"] for e in h], color=colours[o], label=f"{o} answer-token CE")
        if log["val"]:
            axes[2].plot([v["step"] for v in log["val"]], [v["exact_match"] for v in log["val"]],
                         color=colours[o], marker="o", label=f"{o} val exact match")
    axes[0].set_title("training loss (MDM: LLaDA NELBO estimate; ARM: next-token CE)")
    axes[0].set_yscale("log")
    axes[1].set_title("CE on the answer token (masked for MDM)")
    axes[1].set_yscale("log")
    axes[2].set_title("greedy accuracy, 200 val items, 4 distractors")
    axes[2].set_ylim(0, 1)
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # a run without validation points has nothing to label
            ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "training_curves.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--which", choices=["mdm", "arm", "both"], default="both")
    ap.add_argument("--minutes", type=float, default=TrainConfig.minutes, help="wall-time budget per model")
    ap.add_argument("--steps", type=int, default=TrainConfig.steps, help="step budget per model")
    ap.add_argument("--lr", type=float, default=TrainConfig.lr)
    ap.add_argument("--batch-size", type=int, default=TrainConfig.batch_size)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-distractors", type=int, default=TrainConfig.max_distractors)
    ap.add_argument("--hard-negative-frac", type=float, default=TrainConfig.hard_negative_frac,
                    help="share of distractors that use the question's relation")
    ap.add_argument("--curriculum", type=float, default=TrainConfig.curriculum,
                    help="share of training over which max distractors ramps up from 0 (0 = off)")
    ap.add_argument("--out", type=Path, default=ASSETS, help="folder for weights, logs and results "
                    "(default: the shipped assets, which this overwrites)")
    ap.add_argument("--no-eval", action="store_true", help="skip the held-out evaluation")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    from mdm_lens.zoo.evaluate import full_evaluation, plot_evaluation

    results_path = args.out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    for o in (["mdm", "arm"] if args.which == "both" else [args.which]):
        tc = TrainConfig(objective=o, steps=args.steps, minutes=args.minutes, lr=args.lr,
                         batch_size=args.batch_size, seed=args.seed, max_distractors=args.max_distractors,
                         hard_negative_frac=args.hard_negative_frac, curriculum=args.curriculum)
        model, log = train(tc)
        folder = save_twin(model, args.out / NAMES[o].split("/")[-1])
        (args.out / f"training_log_{o}.json").write_text(json.dumps(log, separators=(",", ":")))
        entry = {"steps_done": log["steps_done"], "stopped_by": log["stopped_by"], "wall_s": log["wall_s"],
                 "final_loss": log["history"][-1]["loss"] if log["history"] else None,
                 "n_params": log["n_params"]}
        if not args.no_eval:
            reloaded = HookedMDM.from_pretrained(str(folder))  # score the shipped (fp16-stored) weights
            reloaded.cfg.extra.setdefault("gen_length", tc.gen_length)
            t = time.perf_counter()
            entry["eval"] = full_evaluation(reloaded)
            entry["eval_s"] = round(time.perf_counter() - t, 1)
        results[o] = entry
        results_path.write_text(json.dumps(results, indent=2))
        print(json.dumps({o: entry}, indent=2), flush=True)
    plot_curves(args.out)
    if not args.no_eval:
        plot_evaluation(results, args.out)


if __name__ == "__main__":
    main()
