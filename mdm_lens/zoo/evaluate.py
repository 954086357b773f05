"""Answer accuracy of the zoo twins on the synthetic RAG-QA task, with small local greedy decoders.

* ``greedy_mdm_answer``: the prompt followed by ``gen_length`` mask tokens; ``gen_length`` steps, each
  unmasking the one still-masked canvas position whose top-1 probability is highest (LLaDA's
  "low-confidence remasking" with one token per step) and writing its argmax there.
* ``greedy_arm_answer``: plain greedy next-token decoding of ``gen_length`` tokens.

Both decode batches right-padded with ``<pad>`` (the layout the models were trained on; pads are
hidden as keys from the MDM, and the causal ARM never sees them) and return the answer string read
from the canvas by ``canvas_answer``: the first run of non-``<eos>`` tokens. Scores follow
``mdm_lens.zoo.data.score`` (exact match, word-aligned substring match, token F1).

This module deliberately depends only on ``HookedMDM``'s forward and the zoo data/tokenizer, so that
demos can reuse it without the general sampler.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mdm_lens.zoo import data as D
from mdm_lens.zoo import tokenizer as T

#: The held-out evaluation set of the zoo README (never used for training or model selection).
EVAL_N, EVAL_SEED, EVAL_DISTRACTORS = 500, 1234, 4


def _gen_length(model: Any, gen_length: int | None) -> int:
    if gen_length is not None:
        return gen_length
    return int(model.cfg.extra.get("gen_length", 4))


def _prompt_ids(items: Sequence[D.QAItem]) -> list[list[int]]:
    return [T.encode(it.prompt) for it in items]


def canvas_answer(ids: Sequence[int]) -> str:
    """The answer read from a generated canvas: the first run of tokens that are not ``<eos>``
    (leading ``<eos>`` skipped, stop at the next ``<eos>``/``<pad>``), space-joined."""
    out: list[int] = []
    for i in (int(x) for x in ids):
        if i in (T.EOS_ID, T.PAD_ID):
            if out:
                break
            continue
        out.append(i)
    return T.decode(out)


def _canvas_batch(prompts: list[list[int]], gen_length: int, fill: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``[batch, max_prompt + G]`` ids (canvas filled with ``fill``), attention mask, starts."""
    width = max(len(p) for p in prompts) + gen_length
    ids = torch.full((len(prompts), width), T.PAD_ID, dtype=torch.long)
    am = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, : len(p)] = torch.tensor(p)
        ids[r, len(p) : len(p) + gen_length] = fill
        am[r, : len(p) + gen_length] = 1
    starts = torch.tensor([len(p) for p in prompts])
    return ids, am, starts


@torch.no_grad()
def greedy_mdm_canvas(model: Any, prompts: list[list[int]], gen_length: int) -> list[list[int]]:
    """Greedy low-confidence decoding, one token per step; returns the ``gen_length`` canvas ids per row."""
    mask_id = model.cfg.mask_token_id
    device = model.input_device
    ids, am, starts = _canvas_batch(prompts, gen_length, mask_id)
    ids, am = ids.to(device), am.to(device)
    rows = torch.arange(len(prompts), device=device)
    cols = starts.to(device)[:, None] + torch.arange(gen_length, device=device)[None]  # [batch, G]
    for _ in range(gen_length):
        logits = model(ids, attention_mask=am)[rows[:, None], cols].float()  # [batch, G, vocab]
        logits[..., mask_id] = float("-inf")  # the mask token is never a prediction
        conf, pred = logits.softmax(-1).max(-1)
        still = ids[rows[:, None], cols] == mask_id
        conf = conf.masked_fill(~still, -1.0)
        j = conf.argmax(-1)  # [batch]: most confident still-masked canvas slot
        upd = still[rows, j]
        c = cols[rows, j]
        ids[rows[upd], c[upd]] = pred[rows, j][upd]
    return ids[rows[:, None], cols].tolist()


@torch.no_grad()
def greedy_arm_canvas(model: Any, prompts: list[list[int]], gen_length: int) -> list[list[int]]:
    """Greedy next-token decoding of ``gen_length`` tokens (right padding is invisible to a causal model)."""
    device = model.input_device
    ids, _, starts = _canvas_batch(prompts, gen_length, T.PAD_ID)
    ids = ids.to(device)
    rows = torch.arange(len(prompts), device=device)
    starts = starts.to(device)
    for j in range(gen_length):
        logits = model(ids)[rows, starts + j - 1].float()
        logits[:, model.cfg.mask_token_id] = float("-inf")
        ids[rows, starts + j] = logits.argmax(-1)
    cols = starts[:, None] + torch.arange(gen_length, device=device)[None]
    return ids[rows[:, None], cols].tolist()


def _answers(canvas_fn, model: Any, items: Sequence[D.QAItem], gen_length: int | None, batch_size: int) -> list[str]:
    g = _gen_length(model, gen_length)
    prompts = _prompt_ids(items)
    out: list[str] = []
    was_training = model.training
    model.eval()
    try:
        for s in range(0, len(prompts), batch_size):
            out.extend(canvas_answer(c) for c in canvas_fn(model, prompts[s : s + batch_size], g))
    finally:
        model.train(was_training)
    return out


def greedy_mdm_answer(model: Any, items: Sequence[D.QAItem], gen_length: int | None = None,
                      batch_size: int = 100) -> list[str]:
    """Answer strings of a masked diffusion model, greedy low-confidence decoding (see module doc)."""
    return _answers(greedy_mdm_canvas, model, items, gen_length, batch_size)


def greedy_arm_answer(model: Any, items: Sequence[D.QAItem], gen_length: int | None = None,
                      batch_size: int = 100) -> list[str]:
    """Answer strings of an autoregressive model, greedy decoding of ``gen_length`` tokens."""
    return _answers(greedy_arm_canvas, model, items, gen_length, batch_size)


def greedy_answer(model: Any, items: Sequence[D.QAItem], gen_length: int | None = None,
                  batch_size: int = 100) -> list[str]:
    """``greedy_mdm_answer`` for bidirectional models, ``greedy_arm_answer`` for causal ones."""
    fn = greedy_mdm_answer if model.cfg.attention == "bidirectional" else greedy_arm_answer
    return fn(model, items, gen_length, batch_size)


def accuracy(model: Any, items: Sequence[D.QAItem], gen_length: int | None = None,
             batch_size: int = 100) -> dict[str, float]:
    """``data.score`` of the model's greedy answers (exact_match, substring_match, f1, n)."""
    return D.score(greedy_answer(model, items, gen_length, batch_size), items)


def eval_sets(n: int = EVAL_N, seed: int = EVAL_SEED, n_distractors: int = EVAL_DISTRACTORS
              ) -> dict[str, list[D.QAItem]]:
    """The README's held-out sets: with context (4 distractors, random gold position) and closed-book."""
    return {
        "with_context": D.make_dataset(n, seed=seed, n_distractors=n_distractors),
        "no_context": D.make_dataset(n, seed=seed, no_context=True),
    }


#: The README's sweeps: distractor counts (the twins were trained on 0..4; 6 and 8 test extrapolation)
#: and gold positions 0..4 among the 5 passages of the 4-distractor setting.
DISTRACTOR_SWEEP: tuple[int, ...] = (0, 1, 2, 3, 4, 6, 8)
POSITION_SWEEP: tuple[int, ...] = (0, 1, 2, 3, 4)


#: Share of distractors that use the question's relation (training used 0.5). At 1.0 every passage
#: offers an answer of the right type, so only matching the question's subject beats 1/(k+1).
HARDNESS_SWEEP: tuple[float, ...] = (0.0, 1.0)


def evaluate(model: Any, n: int = EVAL_N, seed: int = EVAL_SEED, distractor_sweep: Sequence[int] = (),
             position_sweep: Sequence[int] = (), hardness_sweep: Sequence[float] = (),
             gen_length: int | None = None) -> dict[str, dict[str, float]]:
    """Scores on ``eval_sets``, plus ``make_dataset(n, seed, n_distractors=k)`` for each k of
    ``distractor_sweep`` (keyed ``distractors_k``), and 4-distractor sets with the gold passage at
    index p for each p of ``position_sweep`` (keyed ``gold_p``) and with a share h of same-relation
    distractors for each h of ``hardness_sweep`` (keyed ``hard_h``)."""
    sets = eval_sets(n, seed)
    for k in distractor_sweep:
        sets[f"distractors_{k}"] = D.make_dataset(n, seed=seed, n_distractors=k)
    for p in position_sweep:
        sets[f"gold_{p}"] = D.make_dataset(n, seed=seed, n_distractors=EVAL_DISTRACTORS, gold_position=p)
    for h in hardness_sweep:
        sets[f"hard_{h:g}"] = D.make_dataset(n, seed=seed, n_distractors=EVAL_DISTRACTORS, hard_negative_frac=h)
    return {name: accuracy(model, items, gen_length) for name, items in sets.items()}


def full_evaluation(model: Any, n: int = EVAL_N) -> dict[str, dict[str, float]]:
    """The README's tables: the held-out sets plus the distractor, gold-position and hardness sweeps."""
    return evaluate(model, n=n, distractor_sweep=DISTRACTOR_SWEEP, position_sweep=POSITION_SWEEP,
                    hardness_sweep=HARDNESS_SWEEP)


def binomial_ci(p: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a proportion (95% by default)."""
    if n <= 0:
        return float("nan"), float("nan")
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * ((p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5) / (1 + z * z / n)
    return centre - half, centre + half


def plot_evaluation(results: dict[str, Any], out: Any) -> list[Any]:
    """``acc_distractors.png`` and ``acc_position.png`` (exact match with 95% Wilson bands, closed-book
    dashed, type-level chance dotted) from a ``results.json``-shaped dict ``{twin: {"eval": ...}}``."""
    from pathlib import Path

    import numpy as np

    from mdm_lens.views import figures

    out = Path(out)
    evals = {name: r["eval"] for name, r in results.items() if "eval" in r}
    label = {"mdm": "tiny-mdm (MDM)", "arm": "tiny-arm (ARM)"}
    paths = []
    for key, xs, xlabel, title, fname in (
        ("distractors_{}", DISTRACTOR_SWEEP, "distractor passages (trained on 0-4)",
         "Exact match vs number of distractors", "acc_distractors.png"),
        ("gold_{}", POSITION_SWEEP, "gold passage index among 5 passages",
         "Exact match vs gold position (lost in the middle?)", "acc_position.png"),
    ):
        series, errors = {}, {}
        for name, ev in evals.items():
            pts = [ev.get(key.format(x)) for x in xs]
            if any(p is None for p in pts):
                continue
            y = np.array([100 * p["exact_match"] for p in pts])
            ci = np.array([binomial_ci(p["exact_match"], int(p["n"])) for p in pts]).T * 100
            series[label.get(name, name)] = y
            errors[label.get(name, name)] = ci
            closed = 100 * ev["no_context"]["exact_match"]
            series[f"{label.get(name, name)}, no context"] = np.full(len(xs), closed)
        if series:
            figures.accuracy_curves(list(xs), series, xlabel=xlabel, title=title, ylabel="exact match (%)",
                                    path=out / fname, errors=errors, chance=100 * type_chance())
            paths.append(out / fname)
    return paths


def type_chance() -> float:
    """Accuracy of guessing a random word of the right answer type, averaged over the relations."""
    pools = [len(D.POOLS[rel.object]) for rel in D.RELATIONS.values()]
    return sum(1 / n for n in pools) / len(pools)


def main(argv: list[str] | None = None) -> None:
    """Re-score the shipped twins (``python -m mdm_lens.zoo.evaluate``): updates the ``eval`` entries
    of ``assets/results.json`` and writes the two accuracy PNGs next to it."""
    import argparse
    import json
    import time
    from pathlib import Path

    from mdm_lens.model import HookedMDM
    from mdm_lens.zoo.recipe import ASSETS, NAMES

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--which", choices=["mdm", "arm", "both"], default="both")
    ap.add_argument("--n", type=int, default=EVAL_N)
    ap.add_argument("--out", type=Path, default=ASSETS)
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    path = args.out / "results.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    for o in (["mdm", "arm"] if args.which == "both" else [args.which]):
        model = HookedMDM.from_pretrained(str(args.out / NAMES[o].split("/")[-1]))
        t = time.perf_counter()
        entry = results.setdefault(o, {})
        entry["eval"] = full_evaluation(model, n=args.n)
        entry["eval_s"] = round(time.perf_counter() - t, 1)
        print(o, {k: v["exact_match"] for k, v in entry["eval"].items()}, flush=True)
    path.write_text(json.dumps(results, indent=2))
    for p in plot_evaluation(results, args.out):
        print(p)


if __name__ == "__main__":
    main()
