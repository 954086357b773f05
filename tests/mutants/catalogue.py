"""The curated mutants: realistic single-point bugs (a sign, an axis, an off-by-one, a dropped factor, a
default changed, an option ignored), each a literal snippet of the source and its replacement.

Keep each `find` unique in its file; tests/test_mutants_catalogue.py fails when one goes stale."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    id: str
    area: str
    file: str
    find: str
    replace: str
    note: str
    tests: tuple[str, ...] = ()  # empty: the whole suite


def _m(id: str, area: str, file: str, find: str, replace: str, note: str) -> Mutant:
    return Mutant(id, area, file, find, replace, note)


D, M, L, H, P = "mdm_lens/diffusion/", "mdm_lens/", "mdm_lens/loading/", "mdm_lens/hooks/", "mdm_lens/probes/"

MUTANTS: list[Mutant] = [
    # --- samplers ---------------------------------------------------------------------------------------------
    _m("dream-entropy-sign", "sampler", D + "dream.py",
       "confidence = torch.sum(probs * torch.log(probs + 1e-10), dim=-1)",
       "confidence = -torch.sum(probs * torch.log(probs + 1e-10), dim=-1)", "entropy confidence with the wrong sign"),
    _m("dream-margin-order", "sampler", D + "dream.py",
       "confidence = top2[:, 0] - top2[:, 1]", "confidence = top2[:, 1] - top2[:, 0]",
       "topk_margin sorted the wrong way"),
    _m("dream-origin-inverted", "sampler", D + "dream.py",
       "p_transfer = 1 - s / t if", "p_transfer = s / t if", "origin's transfer probability inverted"),
    _m("llada-cfg-direction", "sampler", D + "llada.py",
       "logits = un_logits + (cfg_scale + 1) * (logits - un_logits)",
       "logits = un_logits + (cfg_scale + 1) * (un_logits - logits)", "classifier-free guidance reversed"),
    _m("llada-block-bound", "sampler", D + "llada.py",
       "x0_p[:, blk.stop:] = float(\"-inf\")", "x0_p[:, blk.stop + 1:] = float(\"-inf\")",
       "one position past the current block may be decoded"),
    _m("llada-gumbel-exponent", "sampler", D + "llada.py",
       "(-torch.log(u)) ** temperature", "(-torch.log(u)) ** (1 / temperature)",
       "Gumbel noise with the inverse temperature"),
    # --- model ------------------------------------------------------------------------------------------------
    _m("rmsnorm-eps-outside", "model", M + "components.py",
       "(x32.pow(2).mean(-1, keepdim=True) + self.eps).sqrt()", "x32.pow(2).mean(-1, keepdim=True).sqrt() + self.eps",
       "RMSNorm's eps added after the square root"),
    _m("rotary-theta-exponent", "model", M + "components.py",
       "dtype=torch.float32) / d_head))", "dtype=torch.float32) / (d_head - 2)))", "rotary frequencies off by one"),
]
