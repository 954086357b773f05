"""13 — Fast-dLLM v2 (Qwen2.5 turned block-diffusion) on tiny RANDOM weights.

A config.json in the released layout (`Fast_dLLM_QwenForCausalLM`, `model_type: Fast_dLLM_Qwen`, `bd_size`) is
read by the code `HookedMDM.from_pretrained` uses; the weights are random (`from_config`), so the numbers say how
the sampler behaves, not what the trained model does. Shows: every forward of `sampler="fastdllm_v2"` as a step
(prefill, denoise per sub-block, the AR step that emits the next block's first token), how the threshold trades
forwards for parallel commits, and a batch of prompts of different lengths with a stop token.

    python examples/13_fastdllm_v2.py
"""

import json
import tempfile
from collections import Counter
from pathlib import Path

import torch

from mdm_lens import HookedMDM
from mdm_lens.loading import read_config

CONFIG = dict(architectures=["Fast_dLLM_QwenForCausalLM"], model_type="Fast_dLLM_Qwen", bd_size=8, vocab_size=64,
              hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, rope_theta=1e6, mask_token_id=63, pad_token_id=0)
PROMPT = [5, 17, 33, 2, 61, 40, 9, 12, 44, 3]


def build(root: Path) -> HookedMDM:
    folder = root / "fastdllm_v2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIG))
    cfg, _ = read_config(folder, "tiny-fastdllm-v2", None)
    return HookedMDM.from_config(cfg, seed=0, init_std=0.5)


def steps_demo(model: HookedMDM) -> None:
    seen = []

    def hook(x, hook):
        st = model.state
        seen.append((st.step, st.extra["kind"], st.block, st.extra["sub_block"], st.extra["query_start"],
                     st.extra["query_end"]))

    out = model.generate([PROMPT], max_new_tokens=16, small_block_size=4, threshold=0.1, stop_token=62,
                         fwd_hooks=[("blocks.0.hook_resid_pre", hook)])
    per_step = out.trajectory.n_committed[:, 0].tolist()
    print("  step kind     block sub rows    committed")
    for (step, kind, block, sub, lo, hi), n in zip(seen, per_step):
        print(f"  {step:>4} {kind:<8} {block:>5} {'-' if sub is None else sub:>3} [{lo:>2},{hi:>2})  {n}")
    print(f"  tokens: {out.tokens[0].tolist()} (prompt {len(PROMPT)}, returned {out.settings['returned_lengths']})")


def threshold_demo(model: HookedMDM) -> None:
    for threshold in (1.0, 0.2, 0.05, 0.0):
        out = model.generate([PROMPT], max_new_tokens=32, threshold=threshold, stop_token=62)
        gen = out.settings["returned_lengths"][0] - len(PROMPT)
        print(f"  threshold={threshold:<4}: {out.trajectory.n_steps:>2} forwards for {gen} tokens "
              f"(largest parallel commit {int(out.trajectory.n_committed.max())})")


def batch_demo(model: HookedMDM) -> None:
    free = model.generate([PROMPT[:3]], max_new_tokens=16, small_block_size=4, threshold=0.1, stop_token=62)
    stop = int(Counter(free.tokens[0, 3:].tolist()).most_common(1)[0][0])  # a token this model emits
    prompts = [PROMPT[:3], PROMPT, PROMPT + [7, 8, 9, 10, 11, 13]]
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    am = torch.zeros_like(ids)
    for r, p in enumerate(prompts):  # left-padded in, the reference's right-padded layout out
        ids[r, width - len(p):], am[r, width - len(p):] = torch.tensor(p), 1
    out = model.generate(ids, attention_mask=am, max_new_tokens=16, small_block_size=4, threshold=0.1,
                         stop_token=stop)
    for r, p in enumerate(prompts):
        n = out.settings["returned_lengths"][r]
        print(f"  row {r} (prompt {len(p):>2}): {out.tokens[r, len(p):n].tolist()}  (stop token {stop}, pad 0)")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        model = build(Path(tmp))
        c = model.cfg
        print(f"{model!r}\n  family={c.family}, block_length={c.extra['block_length']}, mask id={c.mask_token_id}, "
              f"token shift={c.logit_shift}")
        print("\n== every forward is a step (blocks of 8, sub-blocks of 4)")
        steps_demo(model)
        print("\n== threshold: forwards vs parallel commits")
        threshold_demo(model)
        print("\n== a batch of prompts of different lengths, rows stopping at a stop token")
        batch_demo(model)


if __name__ == "__main__":
    main()
