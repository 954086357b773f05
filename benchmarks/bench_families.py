"""Issue #19's ratios for the 2026 families (LLaDA2.x MoE, LLaDA-MoE, SDAR, SDAR-MoE), in one process
(paired, alternating rounds; `benchmarks.harness`):

(a) `model(tokens)` with no hooks against an independent implementation on the same random weights: LLaDA2 /
    LLaDA-MoE against `benchmarks.reference_families` (plain torch, from the reference modeling code), SDAR /
    SDAR-MoE against transformers' Qwen3 / Qwen3-MoE (SDPA) given the 4-D block-causal mask. Logits are checked
    to agree (max |Δ| ≤ 1e-4) before timing. Target ≤ 1.05.
(b) a step-hooked LLaDA2 trajectory (`sampler="llada2"`, hooks at every step) against the same run without
    hooks. Target ≤ 1.3.
(c) SDAR with its KV cache of finished blocks against recomputing the prefix at every step (a plain loop of
    full block-causal forwards over prefix + block, the sampler's own commit rule); tokens checked identical.
    Reported as a speed-up.

    python -m benchmarks.bench_families                  # d_model 256, 4 layers, T 256
    python -m benchmarks.bench_families --size tiny --repeats 1
"""

from __future__ import annotations

import argparse
import tempfile
import warnings
from pathlib import Path

import torch

from benchmarks import family_weights as fw
from benchmarks.harness import Row, alternate, markdown_table, seconds
from benchmarks.reference_families import llada2_forward, lladamoe_forward
from mdm_lens import HookedMDM, ReceivedAttention

SIZES = {"full": dict(d=256, layers=4, heads=8, kv=4, vocab=4096, experts=16, topk=4, f_dense=688, f_expert=128,
                      seq=256, block=32, prompt=128, gen=128, sdar_block=16, sdar_steps=4),
         "tiny": dict(d=32, layers=2, heads=4, kv=2, vocab=64, experts=8, topk=2, f_dense=64, f_expert=16,
                      seq=24, block=8, prompt=8, gen=16, sdar_block=4, sdar_steps=2)}
TOL = 1e-4


def size_label(s: dict) -> str:
    return (f"{s['layers']} layers, d_model {s['d']}, {s['heads']}/{s['kv']} heads, vocab {s['vocab']}, "
            f"{s['experts']} experts top-{s['topk']} (d_expert {s['f_expert']}, dense d_mlp {s['f_dense']}), "
            f"T {s['seq']}, batch 1, fp32")


def _qwen3(c: dict, sd: dict, moe: bool) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    keys = {k: v for k, v in c.items() if k not in ("architectures", "model_type")}
    rc = Qwen3MoeConfig(**keys) if moe else Qwen3Config(**keys)
    rc._attn_implementation = "sdpa"
    ref = (Qwen3MoeForCausalLM if moe else Qwen3ForCausalLM)(rc)
    state = {k: v for k, v in sd.items() if k in ref.state_dict()}
    for i in range(c["num_hidden_layers"] if moe else 0):  # transformers 5 holds the experts stacked
        if i in c["mlp_only_layers"]:
            continue
        p, n = f"model.layers.{i}.mlp.", c["num_experts"]
        gate_up = [torch.cat([sd[f"{p}experts.{e}.gate_proj.weight"], sd[f"{p}experts.{e}.up_proj.weight"]])
                   for e in range(n)]
        state[p + "experts.gate_up_proj"] = torch.stack(gate_up)
        state[p + "experts.down_proj"] = torch.stack([sd[f"{p}experts.{e}.down_proj.weight"] for e in range(n)])
    ref.load_state_dict(state, strict=True)
    return ref.eval()


def load_family(family: str, s: dict, root: Path) -> tuple[HookedMDM, dict, dict]:
    c = fw.configs(s["d"], s["layers"], s["heads"], s["kv"], s["vocab"], s["experts"], s["topk"], s["f_dense"],
                   s["f_expert"])[family]
    if family in ("llada2", "sdar", "sdar_moe"):
        c["block_length"] = s["block"] if family == "llada2" else s["sdar_block"]
    sd = fw.state_dict(family, c)
    folder = fw.write(root / family, family, c, sd)
    return HookedMDM.from_pretrained(folder), c, sd


def forward_rows(s: dict, root: Path, repeats: int) -> list[Row]:
    rows = []
    tokens = torch.randint(0, s["vocab"] - 4, (1, s["seq"]), generator=torch.Generator().manual_seed(0))
    for family in ("llada2", "lladamoe", "sdar", "sdar_moe"):
        model, c, sd = load_family(family, s, root)
        if family == "llada2":
            mask = fw.block_mask(s["seq"], s["block"])
            ours = lambda: model(tokens, block_length=s["block"])  # noqa: E731
            theirs = lambda: llada2_forward(sd, c, tokens, mask)  # noqa: E731
            what = f"plain-torch transcription (block mask, B {s['block']})"
        elif family == "lladamoe":
            ours = lambda: model(tokens)  # noqa: E731
            theirs = lambda: lladamoe_forward(sd, c, tokens)  # noqa: E731
            what = "plain-torch transcription (bidirectional)"
        else:
            ref = _qwen3(c, sd, family == "sdar_moe")
            mask = fw.block_mask(s["seq"], s["sdar_block"])
            ours = lambda: model(tokens, block_length=s["sdar_block"])  # noqa: E731
            theirs = lambda ref=ref, mask=mask: ref(tokens, attention_mask=mask).logits  # noqa: E731
            arch = "Qwen3-MoE" if family == "sdar_moe" else "Qwen3"
            what = f"transformers {arch} sdpa, 4-D block mask (B {s['sdar_block']})"
        delta = (ours() - theirs()).abs().max().item()
        if not delta <= TOL:
            raise AssertionError(f"{family}: logits differ from the independent implementation by {delta:.2e}")
        t = alternate(ours, theirs, repeats)
        rows.append(Row("F(a) forward", f"{family} vs {what}", seconds(t.a_med), seconds(t.b_med), t.ratio, "≤ 1.05",
                        t.ratio <= 1.05, f"max Δ {delta:.1e}; {t.spread()}"))
    return rows


def trajectory_rows(s: dict, root: Path, repeats: int) -> list[Row]:
    model, _, _ = load_family("llada2", s, root)
    prompt = torch.randint(0, s["vocab"] - 4, (1, s["prompt"]), generator=torch.Generator().manual_seed(1))
    kw = dict(sampler="llada2", gen_length=s["gen"], block_length=s["block"], steps=s["block"], threshold=1.0,
              progress=False)  # threshold above 1: the schedule's count every step, so the step count is fixed
    plain = lambda: model.generate(prompt, **kw)  # noqa: E731
    base = plain()
    n = base.trajectory.n_steps
    seen = []
    hooked = {
        "ReceivedAttention() on every layer, every step":
            lambda: model.generate(prompt, record=[ReceivedAttention()], **kw),
        "cache= blocks.*.hook_resid_post, every step":
            lambda: model.generate(prompt, cache="blocks.*.hook_resid_post", **kw),
        "fwd_hooks on every hook_resid_post, every step": lambda: model.generate(
            prompt, fwd_hooks=[("blocks.*.hook_resid_post", lambda x, hook: seen.append(1))], **kw),
    }
    rows = []
    for label, fn in hooked.items():
        if not torch.equal(fn().tokens, base.tokens):
            raise AssertionError(f"{label}: tokens differ from the run without hooks")
        t = alternate(fn, plain, repeats)
        rows.append(Row("F(b) llada2 trajectory", f"{label} vs no hooks ({n} steps)", seconds(t.a_med),
                        seconds(t.b_med), t.ratio, "≤ 1.3", t.ratio <= 1.3, t.spread()))
    return rows


@torch.no_grad()
def sdar_recompute(model: HookedMDM, prompt: torch.Tensor, gen: int, bl: int, steps: int) -> torch.Tensor:
    """SDAR's decoding (top_k=1, `low_confidence_static`) with no cache: each step one block-causal forward over
    everything up to the current block's end; the block's rows of its logits commit the schedule's count."""
    from mdm_lens.diffusion.blockwise import layout, sample_tokens, transfer_schedule
    from mdm_lens.diffusion.sdar import transfer

    mask_id = model.cfg.mask_token_id
    p = prompt.shape[1]
    first, num_blocks, total = layout(p, gen, bl)
    x = torch.full((1, total), mask_id, dtype=torch.long)
    x[:, :p] = prompt
    schedule = transfer_schedule(bl, steps)
    g = torch.Generator().manual_seed(0)
    for nb in range(first, num_blocks):
        lo, hi = nb * bl, (nb + 1) * bl
        for i in range(steps):
            mask_index = x[:, lo:hi] == mask_id
            if not bool(mask_index.any()):
                break
            logits = model(x[:, :hi], block_length=bl)[:, lo:hi]
            x0, x0_p = sample_tokens(logits, 1.0, 1, 1.0, g)
            chosen = transfer("low_confidence_static", mask_index, x0_p, schedule[i], 0.0, None)
            blk = x[:, lo:hi]
            blk[chosen] = x0[chosen]
    return x[:, : p + gen]


def sdar_rows(s: dict, root: Path, repeats: int) -> list[Row]:
    rows = []
    for family in ("sdar", "sdar_moe"):
        model, _, _ = load_family(family, s, root)
        prompt = torch.randint(0, s["vocab"] - 4, (1, s["prompt"]), generator=torch.Generator().manual_seed(2))
        kw = dict(sampler="sdar", gen_length=s["gen"], block_length=s["sdar_block"], steps=s["sdar_steps"],
                  temperature=1.0, top_k=1, remasking_strategy="low_confidence_static", progress=False)
        cached = lambda: model.generate(prompt, **kw)  # noqa: E731
        recompute = lambda: sdar_recompute(model, prompt, s["gen"], s["sdar_block"], s["sdar_steps"])  # noqa: E731
        out = cached()
        if not torch.equal(out.tokens, recompute()):
            raise AssertionError(f"{family}: the KV-cached run and the recomputing loop decode different tokens")
        t = alternate(cached, recompute, repeats)
        rows.append(Row("F(c) sdar KV cache", f"{family}: cache of finished blocks vs recompute prefix "
                        f"(prompt {s['prompt']}, gen {s['gen']}, B {s['sdar_block']}, {s['sdar_steps']} steps/block)",
                        seconds(t.a_med), seconds(t.b_med), 1 / t.ratio, "(report)", None,
                        f"{out.trajectory.n_steps} cached forwards; {t.spread()} (of cached/recompute)", speedup=True))
    return rows


def run(size: str = "full", repeats: int = 11, traj_repeats: int = 5, only: str = "a,b,c") -> list[Row]:
    s = SIZES[size]
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("ignore")
        root = Path(tmp)
        if "a" in only:
            rows += forward_rows(s, root, repeats)
        if "b" in only:
            rows += trajectory_rows(s, root, traj_repeats)
        if "c" in only:
            rows += sdar_rows(s, root, traj_repeats)
    return rows


def main(argv: list[str] | None = None) -> int:
    from benchmarks.harness import HEADER

    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_families", description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=list(SIZES), default="full")
    p.add_argument("--repeats", type=int, default=11, help="forward rounds (default 11)")
    p.add_argument("--traj-repeats", type=int, default=5, help="trajectory rounds (default 5)")
    p.add_argument("--only", default="a,b,c", help="subset of a,b,c")
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    print(size_label(SIZES[a.size]))
    print(markdown_table(HEADER, [r.cells() for r in run(a.size, a.repeats, a.traj_repeats, a.only)]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
