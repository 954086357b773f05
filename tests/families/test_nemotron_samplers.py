"""Nemotron-Labs-Diffusion's samplers are token-exact against transcriptions of the hub `generate` / `ar_generate`
(incremental DynamicCache-style KV cache, the reference's RNG order, run on the plain-torch reference forward of
nemotron_fixture.py; the random draws from the same seeded CPU generator)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from nemotron_fixture import EOS_ID, MASK_ID, extend, reference_forward, write_nemotron

from mdm_lens import HookedMDM
from mdm_lens.errors import SamplerConfigError

PROMPT = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(3))


def _pick(logit, temperature, g):
    if temperature > 0:
        return torch.multinomial(torch.softmax(logit / temperature, dim=-1), 1, generator=g)
    return torch.argmax(logit, dim=-1, keepdim=True)


def _transfer(logits, temperature, mask_index, x, num_transfer, threshold, g):
    noisy = logits
    if temperature != 0:
        noise = torch.rand(logits.shape, dtype=torch.float64, generator=g)
        noisy = logits.to(torch.float64).exp() / (-torch.log(noise)) ** temperature
    x0 = torch.argmax(noisy, dim=-1)
    p = F.softmax(logits, dim=-1)
    x0_p = torch.squeeze(torch.gather(p, dim=-1, index=torch.unsqueeze(x0, -1)), -1)
    x0 = torch.where(mask_index, x0, x)
    confidence = torch.where(mask_index, x0_p, -float("inf"))
    transfer = torch.zeros_like(x0, dtype=torch.bool)
    if threshold is not None:
        num_transfer = mask_index.sum(dim=1, keepdim=True)
    for j in range(confidence.shape[0]):
        _, select = torch.topk(confidence[j], k=int(num_transfer[j]))
        transfer[j, select] = True
        if threshold is not None:
            for k in range(1, int(num_transfer[j])):
                if confidence[j, select[k]] < threshold:
                    transfer[j, select[k]] = False
    return x0, transfer


def reference_generate(sd, config, prompt, max_new_tokens, block_length, threshold=None, temperature=0.0,
                       eos_token_id=EOS_ID, seed=0):
    """The hub `generate` with causal_context=True (transcribed), returning (ids, nfe)."""
    g = torch.Generator().manual_seed(seed)
    x, b = prompt.clone(), prompt.shape[0]
    logits, new = reference_forward(sd, config, prompt, None, causal=True)
    past, nfe = extend(None, new), 0
    next_token = _pick(logits[:, -1], temperature, g)
    for nb in range(max_new_tokens // block_length):
        block = torch.full((b, block_length), MASK_ID, dtype=prompt.dtype)
        block[:, 0] = next_token[:, 0]
        x = torch.cat([x, block], 1)
        lo = prompt.shape[1] + nb * block_length
        sl = slice(lo, lo + block_length)
        m0 = x[:, sl] == MASK_ID
        count = m0.sum(1, keepdim=True)
        ntt = torch.zeros(b, block_length, dtype=torch.int64) + count // block_length
        for i in range(b):
            ntt[i, : int(count[i] % block_length)] += 1
        for i in range(block_length):
            mi = x[:, sl] == MASK_ID
            if mi.sum() == 0:
                break
            nfe += 1
            lg, _ = reference_forward(sd, config, x[:, sl], past, causal=False)
            x0, tr = _transfer(lg, temperature, mi, x[:, sl], ntt[:, i], threshold, g)
            cur = x[:, sl].clone()
            cur[tr] = x0[tr]
            x[:, sl] = cur
            bt = x[:, sl]
            eos = bt == eos_token_id
            if eos_token_id is not None and eos.any(dim=1).any():
                before = (bt == MASK_ID) & ~eos.cumsum(dim=1).bool()
                if (eos.any(dim=1) & ~before.any(dim=1)).any():
                    break
        lg, new = reference_forward(sd, config, x[:, sl], past, causal=True)
        past, nfe = extend(past, new), nfe + 1
        next_token = _pick(lg[:, -1], temperature, g)
        is_eos = x[:, prompt.shape[1]:] == eos_token_id
        if eos_token_id is not None and is_eos.any(dim=1).all():
            return x[:, : prompt.shape[1] + int(is_eos.long().argmax(1).max()) + 1], nfe
    return x, nfe


def reference_ar_generate(sd, config, prompt, max_new_tokens, temperature=0.0, eos_token_id=EOS_ID, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits, new = reference_forward(sd, config, prompt, None, causal=True)
    past, out = extend(None, new), []
    nxt = logits[:, -1]
    for step in range(max_new_tokens):
        tok = _pick(nxt, temperature, g)
        out.append(tok)
        if eos_token_id is not None and (tok == eos_token_id).all():
            break
        if step < max_new_tokens - 1:
            logits, new = reference_forward(sd, config, tok, past, causal=True)
            past, nxt = extend(past, new), logits[:, -1]
    return torch.cat([prompt, *out], 1)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    folder, config, sd = write_nemotron(tmp_path_factory.mktemp("nemotron") / "ckpt")
    return HookedMDM.from_pretrained(str(folder)), config, sd


@pytest.mark.parametrize("threshold, temperature, seed", [(None, 0.0, 0), (0.3, 0.0, 0), (None, 0.8, 4),
                                                          (0.2, 1.3, 7)])
def test_block_sampler_is_token_exact(ckpt, threshold, temperature, seed):
    model, config, sd = ckpt
    want, nfe = reference_generate(sd, config, PROMPT, 12, 4, threshold, temperature, seed=seed)
    out = model.generate(PROMPT, sampler="nemotron", gen_length=12, threshold=threshold, temperature=temperature,
                         seed=seed)
    assert torch.equal(out.tokens, want)
    assert out.answer_length is None and len(out.trajectory.x_steps) == nfe + 1  # + the prefill
    assert (out.tokens[:, 7:] != MASK_ID).all()


def test_auto_picks_the_block_sampler_and_the_checkpoint_block_size(ckpt):
    model, config, sd = ckpt
    out = model.generate(PROMPT, gen_length=8)
    assert out.sampler == "nemotron" and out.settings["block_length"] == 4 and out.settings["eos_id"] == EOS_ID
    assert torch.equal(out.tokens, reference_generate(sd, config, PROMPT, 8, 4)[0])


def test_stops_at_eos_as_the_reference(ckpt):
    model, config, sd = ckpt
    row = PROMPT[1:]
    # planted stop: the token the free greedy run emits in the second block becomes the EOS id
    stop = int(model.generate(row, sampler="nemotron", gen_length=12).tokens[0, 7 + 5])
    model.cfg.eos_token_id = stop
    try:
        out = model.generate(row, sampler="nemotron", gen_length=12)
    finally:
        model.cfg.eos_token_id = EOS_ID
    want, _ = reference_generate(sd, config, row, 12, 4, eos_token_id=stop)
    n = want.shape[1] - 7
    assert n <= 6 and out.answer_length == [n] and torch.equal(out.tokens[:, : 7 + n], want)
    assert int(out.tokens[0, 6 + n]) == stop and (out.tokens[0, 7 + 9:] == MASK_ID).all()  # block 3: its seed only


@pytest.mark.parametrize("temperature, seed", [(0.0, 0), (0.9, 3)])
def test_ar_mode_is_token_exact(ckpt, temperature, seed):
    model, config, sd = ckpt
    want = reference_ar_generate(sd, config, PROMPT, 6, temperature, seed=seed)
    out = model.generate(PROMPT, sampler="nemotron_ar", gen_length=6, temperature=temperature, seed=seed)
    assert torch.equal(out.tokens, want)


def test_ar_mode_is_not_the_diffusion_mode(ckpt):
    model, _, _ = ckpt
    ar = model.generate(PROMPT, sampler="nemotron_ar", gen_length=8).tokens
    dlm = model.generate(PROMPT, sampler="nemotron", gen_length=8).tokens
    assert torch.equal(ar[:, 7], dlm[:, 7])  # the block's slot 0 is the AR seed
    assert not torch.equal(ar, dlm)


@pytest.mark.parametrize("kw, words", [(dict(gen_length=10), "multiple"), (dict(causal_context=False), "causal"),
                                       (dict(threshold=1.5), "threshold"), (dict(temperature=-1), "temperature")])
def test_settings_are_checked(ckpt, kw, words):
    with pytest.raises(SamplerConfigError, match=words):
        ckpt[0].generate(PROMPT, sampler="nemotron", **kw)
