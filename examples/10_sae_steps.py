"""10 — A TopK SAE per band of denoising steps on tiny-mdm, and which latents fire on floating anchors.

The twin answers zoo QA prompts with the LLaDA sampler (one commit per step). Along the way we cache
`blocks.{L}.hook_resid_post` at every step and record the attention each key receives at layer L; the
floating anchors of a step are the zscore anchors of the head-mean received attention (`anchors_over_steps`,
`mdm_lens.probes.floating.detect_anchors`). The steps are cut into bands (early / mid / late). Per band we train
a TopK SAE on the residual stream of every visible position at those steps -- SAELens' `TopKSAE` when sae-lens
is importable, else a few-line TopK SAE with the same surface (`encode`, `decode`, `W_dec`) -- and rank its
latents by how selectively they fire on anchors: rate on anchor rows, rate on the other rows, and the
share of a latent's firings that land on anchors -- and, as a control, the rate on non-anchor rows holding
the same tokens as the anchors ([MASK], <eos>, ...), which separates "fires on the anchor role" from "fires on
that token". Last, the decoder direction of each band's most
anchor-selective latent is run on the other bands' rows: is "anchor" one feature across the denoising steps
or a different one per band?

    python examples/10_sae_steps.py [--n 24] [--steps 8] [--bands 3] [--layer 2] [--d-sae 256] [--k 8]
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from collections import Counter
from dataclasses import dataclass

import pandas as pd
import torch
from torch import Tensor

from mdm_lens import HookedMDM, ReceivedAttention, steps
from mdm_lens.probes.run import anchors_over_steps
from mdm_lens.zoo import data as D
from _common import load  # noqa: E402  (examples/ is on sys.path when run as a script)

pd.set_option("display.width", 200, "display.max_columns", 20, "display.precision", 3)
HAVE_SAE_LENS = importlib.util.find_spec("sae_lens") is not None


@dataclass
class Rows:
    """One row per (step, item, visible key): the residual stream, whether the key is an anchor at that step,
    the token the key holds at that step ([MASK] while masked) and the step."""

    acts: Tensor        # [row, d_model]
    anchor: Tensor      # [row] bool
    token: list[str]
    step: Tensor        # [row]


def trajectories(model: HookedMDM, n: int, n_steps: int, layer: int, seed: int = 7) -> tuple[Rows, int]:
    """Generate answers to `n` zoo prompts; return the rows of every step, and the number of steps."""
    items = D.make_dataset(n, seed=seed, n_distractors=4)
    ids, am = model.to_tokens([it.prompt for it in items], return_attention_mask=True)
    hook = f"blocks.{layer}.hook_resid_post"
    out = model.generate(ids, attention_mask=am, steps=n_steps, gen_length=n_steps,
                         record=[ReceivedAttention(layers=[layer])], cache=hook @ steps())
    anchors = anchors_over_steps(out, layer=layer).anchors.transpose(0, 1)   # [step, batch, key]
    acts = out.cache.stack(hook)                                              # [step, batch, pos, d]
    visible = out.key_visible[None].expand(anchors.shape)
    canvas = out.trajectory.x_steps                                           # [step, batch, pos], before commits
    names = model.to_str_tokens(torch.arange(model.cfg.d_vocab))
    names[model.cfg.mask_token_id] = "[MASK]"
    step_of = torch.arange(anchors.shape[0])[:, None, None].expand(anchors.shape)
    return Rows(acts[visible], anchors[visible], [names[t] for t in canvas[visible].tolist()],
                step_of[visible]), out.n_steps


class TinyTopK(torch.nn.Module):
    """A TopK SAE with SAELens' surface (`encode`, `decode`, `W_enc`, `W_dec`, `b_enc`, `b_dec`): the stand-in when
    sae-lens is not installed. encode(x) = the k largest of relu((x - b_dec) W_enc + b_enc), the rest 0."""

    def __init__(self, d_in: int, d_sae: int, k: int):
        super().__init__()
        self.k = k
        self.W_enc = torch.nn.Parameter(torch.empty(d_in, d_sae))
        self.W_dec = torch.nn.Parameter(torch.empty(d_sae, d_in))
        self.b_enc = torch.nn.Parameter(torch.zeros(d_sae))
        self.b_dec = torch.nn.Parameter(torch.zeros(d_in))

    def encode(self, x: Tensor) -> Tensor:
        pre = torch.relu((x - self.b_dec) @ self.W_enc + self.b_enc)
        top = pre.topk(self.k, dim=-1)
        return torch.zeros_like(pre).scatter(-1, top.indices, top.values)

    def decode(self, z: Tensor) -> Tensor:
        return z @ self.W_dec + self.b_dec


def make_sae(d_in: int, d_sae: int, k: int) -> torch.nn.Module:
    if HAVE_SAE_LENS:
        from sae_lens import TopKSAE, TopKSAEConfig

        return TopKSAE(TopKSAEConfig(d_in=d_in, d_sae=d_sae, k=k))
    return TinyTopK(d_in, d_sae, k)


def train_sae(x: Tensor, d_sae: int, k: int, n_updates: int, seed: int = 0, batch: int = 256) -> torch.nn.Module:
    """Adam on the reconstruction MSE. Init as usual for SAEs: unit-norm decoder rows, encoder = decoder^T,
    b_dec = the data mean. Decoder rows are renormalised after each update (so activations carry the scale)."""
    torch.manual_seed(seed)
    sae = make_sae(x.shape[1], d_sae, k)
    with torch.no_grad():
        w = torch.randn(d_sae, x.shape[1])
        sae.W_dec.copy_(w / w.norm(dim=1, keepdim=True))
        sae.W_enc.copy_(sae.W_dec.T)
        sae.b_enc.zero_()
        sae.b_dec.copy_(x.mean(0))
    opt = torch.optim.Adam(sae.parameters(), lr=2e-3)
    g = torch.Generator().manual_seed(seed)
    for _ in range(n_updates):
        xb = x[torch.randint(len(x), (min(batch, len(x)),), generator=g)]
        loss = ((sae.decode(sae.encode(xb)) - xb) ** 2).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            sae.W_dec /= sae.W_dec.norm(dim=1, keepdim=True)
    return sae


def anchor_latents(sae: torch.nn.Module, rows: Rows, scale: float, top: int = 5) -> tuple[pd.DataFrame, dict]:
    """Per latent: firing rate on anchor rows and on the others, and P(anchor | fires); the `top` latents by
    rate difference (with the anchor tokens they fire on). Plus the band's reconstruction FVU and mean L0."""
    x = rows.acts / scale
    with torch.no_grad():
        z = sae.encode(x)
        fvu = float(((sae.decode(z) - x) ** 2).sum() / ((x - x.mean(0)) ** 2).sum())
    fires = z > 0
    a = rows.anchor
    rate_anchor, rate_other = fires[a].float().mean(0), fires[~a].float().mean(0)
    precision = (fires & a[:, None]).sum(0) / fires.sum(0).clamp_min(1)
    order = (rate_anchor - rate_other).argsort(descending=True)[:top]
    # control: non-anchor rows holding a token that some anchor holds ([MASK], <eos>, ...). A latent that fires
    # there as often as on anchors reads the token, not the anchor role.
    anchor_tokens = {rows.token[i] for i in a.nonzero().flatten().tolist()}
    same = torch.tensor([t in anchor_tokens for t in rows.token]) & ~a
    table = []
    for lat in order.tolist():
        on = (fires[:, lat] & a).nonzero().flatten().tolist()
        tokens = Counter(rows.token[i] for i in on).most_common(3)
        table.append(dict(latent=lat, on_anchors=float(rate_anchor[lat]), elsewhere=float(rate_other[lat]),
                          same_token_elsewhere=float(fires[same, lat].float().mean()) if same.any() else float("nan"),
                          p_anchor_if_fires=float(precision[lat]) if fires[:, lat].any() else float("nan"),
                          anchor_tokens=", ".join(f"{t!r}x{c}" for t, c in tokens)))
    norm = rows.acts.norm(dim=-1)
    stats = dict(rows=len(x), anchors=int(a.sum()), fvu=fvu, l0=float(fires.sum(-1).float().mean()),
                 dead=int((~fires.any(0)).sum()), base_rate=float(a.float().mean()),
                 norm_ratio=float(norm[a].mean() / norm[~a].mean()))
    return pd.DataFrame(table), stats


def bands_of(n_steps: int, n_bands: int) -> list[list[int]]:
    return [b.tolist() for b in torch.arange(n_steps).tensor_split(n_bands)]


def transfer(saes: list[torch.nn.Module], best: list[int], parts: list[Rows], scale: float) -> pd.DataFrame:
    """The top anchor latent of band a's SAE, run on band b's rows: its firing rate on b's anchors / elsewhere.
    High on the diagonal only: each band has its own anchor feature; high across: one feature for all steps."""
    out = {}
    for a, sae in enumerate(saes):
        cells = []
        for part in parts:
            with torch.no_grad():
                f = sae.encode(part.acts / scale)[:, best[a]] > 0
            cells.append(f"{float(f[part.anchor].float().mean()):.2f} / {float(f[~part.anchor].float().mean()):.2f}")
        out[f"band {a} SAE, latent {best[a]}"] = cells
    return pd.DataFrame(out, index=[f"rows of band {b}" for b in range(len(parts))]).T


def main(n: int = 24, n_steps: int = 8, n_bands: int = 3, layer: int = 2, d_sae: int = 256, k: int = 8,
         n_updates: int = 300, seed: int = 0) -> dict:
    t0 = time.time()
    model = load("mdm-lens/tiny-mdm")
    rows, n_steps = trajectories(model, n, n_steps, layer)
    scale = float(rows.acts.pow(2).sum(-1).mean().sqrt()) / model.cfg.d_model ** 0.5  # mean |x|^2 = d_model
    print(f"SAE: {'sae_lens.TopKSAE' if HAVE_SAE_LENS else 'TinyTopK (sae-lens not installed)'}, d_sae={d_sae}, "
          f"k={k}, on blocks.{layer}.hook_resid_post / {scale:.3g}; {len(rows.step)} rows from {n} prompts x "
          f"{n_steps} steps ({time.time() - t0:.1f}s)")
    saes, best, parts, results = [], [], [], {}
    for b, band in enumerate(bands_of(n_steps, n_bands)):
        sel = torch.isin(rows.step, torch.tensor(band))
        part = Rows(rows.acts[sel], rows.anchor[sel], [t for t, s in zip(rows.token, sel.tolist()) if s],
                    rows.step[sel])
        sae = train_sae(part.acts / scale, d_sae, k, n_updates, seed=seed + b)
        table, stats = anchor_latents(sae, part, scale)
        print(f"\n== band {b}: steps {band} — {stats['rows']} rows, {stats['anchors']} anchors "
              f"(base rate {stats['base_rate']:.3f}); FVU {stats['fvu']:.3f}, L0 {stats['l0']:.1f}, "
              f"dead latents {stats['dead']}; |x| on anchors / elsewhere {stats['norm_ratio']:.2f} ==")
        print(table.to_string(index=False))
        saes.append(sae)
        parts.append(part)
        best.append(int(table.latent[0]))
        results[b] = dict(steps=band, table=table, **stats)
    overlap = transfer(saes, best, parts, scale)
    print("\n== each band's top anchor latent on every band's rows: rate on anchors / elsewhere ==")
    print(overlap)
    print(f"\ndone in {time.time() - t0:.1f}s")
    return dict(bands=results, overlap=overlap)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=24)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--bands", type=int, default=3)
    ap.add_argument("--layer", type=int, default=2)
    ap.add_argument("--d-sae", type=int, default=256)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--updates", type=int, default=300)
    a = ap.parse_args()
    # a tiny model: thousands of small ops, for which a thread pool only adds barriers (on a busy 2-core CPU,
    # one thread ran example 10 in 16 s where two took 190 s)
    torch.set_num_threads(1)
    main(a.n, a.steps, a.bands, a.layer, a.d_sae, a.k, a.updates)
