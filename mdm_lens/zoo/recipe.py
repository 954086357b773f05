"""Zoo twins, part 1: where the twins live (``ASSETS``, their registry ``NAMES``), the training and
architecture configs and the twin's `MDMConfig`. Shared by training and evaluation (neither imports the other)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from mdm_lens.config import MDMConfig
from mdm_lens.zoo import tokenizer as T

ASSETS = Path(__file__).resolve().parent / "assets"
Objective = Literal["mdm", "arm"]
NAMES = {"mdm": "mdm-lens/tiny-mdm", "arm": "mdm-lens/tiny-arm"}
EPS = 1e-3  # LLaDA's minimum masking probability


@dataclass
class TrainConfig:
    objective: Objective = "mdm"
    steps: int = 18000
    minutes: float = 20.0
    batch_size: int = 32
    lr: float = 1e-3
    warmup: int = 150
    min_lr_frac: float = 0.1
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    sft_frac: float = 0.9
    mask_schedule: Literal["count", "continuous"] = "count"  # MDM masking-ratio sampler (see mdm_masks)
    gen_length: int = 4
    seed: int = 0  # model init and masking noise
    data_seed: int = 0  # the batch stream, shared by both twins
    max_distractors: int = 4
    curriculum: float = 0.4  # max distractors ramps 0 -> max_distractors over this share of training (0 = off)
    no_context_frac: float = 0.1
    hard_negative_frac: float = 0.5  # share of distractors that use the question's relation
    bucket: int = 8  # batches drawn together and length-sorted (less padding)
    log_every: int = 20
    val_every: int = 1000  # greedy accuracy on a small validation set (0 = never)
    val_n: int = 200
    val_seed: int = 999  # disjoint from the README's test seed 1234
    threads: int = 2
    verbose: bool = True


@dataclass
class ArchConfig:
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 4
    d_mlp: int = 384
    n_ctx: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    extra: dict[str, Any] = field(default_factory=dict)


def model_config(objective: Objective, arch: ArchConfig | None = None, gen_length: int = 4,
                 recipe: dict[str, Any] | None = None) -> MDMConfig:
    """The twin's `MDMConfig`: identical for both objectives except attention and name."""
    a = arch or ArchConfig()
    extra = {"gen_length": gen_length, "prepend_bos": False, "objective": objective, **a.extra}
    if recipe:
        extra["recipe"] = recipe
    return MDMConfig(
        d_model=a.d_model, n_layers=a.n_layers, n_heads=a.n_heads, n_kv_heads=a.n_kv_heads, d_mlp=a.d_mlp,
        d_vocab=T.vocab_size(), n_ctx=a.n_ctx, rope_theta=a.rope_theta, norm_eps=a.norm_eps,
        attention="bidirectional" if objective == "mdm" else "causal",
        mask_token_id=T.MASK_ID, bos_token_id=T.BOS_ID, eos_token_id=T.EOS_ID, pad_token_id=T.PAD_ID,
        family="mdm_lens", model_name=NAMES[objective], extra=extra,
    )
