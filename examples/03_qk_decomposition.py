"""03 — Norm vs angle split of the anchor key's QK advantage, per layer (spec §3.6).

One clean forward on each final sequence (prompt + generated answer); the anchor is the top-1
received key of each layer (head mean); Δ = N + G per head, then averaged over heads and prompts.

    python examples/03_qk_decomposition.py [--n 16]
"""

import argparse
import time
from collections import Counter

import pandas as pd
import torch

from mdm_lens import HookedMDM, MDMConfig
from mdm_lens.errors import MDMLensError
from mdm_lens.probes.run import generate_final, qk_at_layer
from mdm_lens.zoo import data as D
from mdm_lens.zoo import tokenizer as ZT

pd.set_option("display.width", 200, "display.max_columns", 40, "display.precision", 3)


def load(name: str) -> HookedMDM:
    """The zoo twin if it is installed, else a random tiny model of the same interface (with a notice)."""
    try:
        return HookedMDM.from_pretrained(name)
    except MDMLensError as e:
        print(f"[notice] {name} is not available ({type(e).__name__}); using a RANDOM tiny model instead — "
              "numbers below are not the trained twin's.")
        cfg = MDMConfig(d_model=64, n_layers=4, n_heads=4, d_mlp=128, d_vocab=ZT.vocab_size(), n_ctx=128,
                        mask_token_id=ZT.MASK_ID, bos_token_id=ZT.BOS_ID, eos_token_id=ZT.EOS_ID,
                        pad_token_id=ZT.PAD_ID, attention="causal" if name.endswith("arm") else "bidirectional",
                        model_name=f"random:{name}", extra={"gen_length": 4})
        return HookedMDM.from_config(cfg, seed=0, init_std=0.2)
def main(n: int) -> None:
    items = D.make_dataset(n, seed=1234, n_distractors=4)
    prompts = [torch.tensor(ZT.encode(it.prompt)) for it in items]
    for name in ("mdm-lens/tiny-mdm", "mdm-lens/tiny-arm"):
        model = load(name)
        toks, am, _ = generate_final(model, prompts)
        rows = []
        for layer in range(model.cfg.n_layers):
            res = qk_at_layer(model, toks, layer, attention_mask=am)
            df = res.to_frame()
            wide = df[df.metric.isin(["norm_term", "angle_term", "advantage", "key_norm_ratio", "cos_gap",
                                      "value_norm_ratio"])].groupby("metric").value.mean()
            rows.append(dict(layer=layer, anchor_pos_median=float(res.anchor[:, 0].float().median()), **wide,
                             head_mean_label=Counter(res.labels_mean.tolist()).most_common(1)[0][0],
                             per_head_labels=dict(Counter(res.labels.flatten().tolist()))))
        print(f"\n== {model.cfg.model_name}: QK advantage of the top-1 anchor (logits), mean over heads × {n} ==")
        print(pd.DataFrame(rows).set_index("layer"))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=16)
    t0 = time.time()
    main(ap.parse_args().n)
    print(f"\n[{time.time() - t0:.1f} s]")
