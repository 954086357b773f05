"""An independent plain-torch transcription of SGLang's `JointThresholdInDel` (sgl-project/sglang@7c7e7941
python/sglang/srt/dllm/algorithm/joint_threshold_indel.py; families-2.md §10) driven block by block as its
`DllmAlgorithm` run loop does (forward, then `step` until it reports done, at most `block_size +
max_post_edit_steps + 1` times), on one prompt with blocks aligned at position 0. The KV cache of earlier blocks
is replaced by forwarding the canvas prefix under the block-causal mask. Written from the reference's steps on
plain Python lists; shares no code with mdm_lens.diffusion.indel."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _edit_ops(tokens, old, orig, mask_id, delete_id, split_id, size):
    out, flags = [], []
    for i, t in enumerate(tokens):
        if t == delete_id:
            continue
        if t == split_id:
            out.extend([mask_id, old[i]])
            flags.extend([False, orig[i]])
        else:
            out.append(t)
            flags.append(orig[i])
    if len(out) > size:
        return out[:size], flags[:size]
    return out + [mask_id] * (size - len(out)), flags + [False] * (size - len(out))


def _step(logits, block, st, *, mask_id, delete_id, split_id, threshold, edit_threshold, max_post):
    """One `step` on one block (a `[size]` long tensor edited in place); returns (done, new block)."""
    x = logits.argmax(-1)
    p = F.softmax(logits, dim=-1).gather(-1, x[:, None]).squeeze(-1)
    mask_index = block == mask_id
    orig = torch.tensor(st["is_orig_mask"])
    n_orig = int((orig & mask_index).sum())
    total = int(mask_index.sum())
    n_new = total - n_orig
    m2t = torch.zeros_like(mask_index)
    if mask_index.any():
        conf = torch.where(mask_index, p, torch.tensor(float("-inf")))
        if n_orig > 0:
            high = (conf > threshold) & mask_index
            if int(high.sum()) >= 1 + n_new:
                m2t = high
            else:
                k = min(1 + n_new, total)
                if k > 0:
                    m2t[torch.topk(conf, k=k).indices] = True
        else:
            m2t = mask_index
    force = False
    if n_orig == 0:
        st["post_edit_steps"] += 1
        if st["post_edit_steps"] > max_post:
            force = True
            bad = (x == delete_id) | (x == split_id)
            if bad.any():
                where = bad.nonzero().view(-1)
                lg = logits[where].clone()
                lg[:, delete_id] = float("-inf")
                lg[:, split_id] = float("-inf")
                x[where] = lg.argmax(-1)
    t2t = (p > edit_threshold) & (block != x) & ~mask_index & ~st["prompt_mask"]
    transfer = m2t | t2t
    if not transfer.any():
        return True, block
    old = block.tolist()
    if tuple(old) in st["seen"] and not force:
        changing = (transfer & (x != block)).nonzero().view(-1).tolist()
        if changing:
            chosen = changing[int(p[torch.tensor(changing)].argmin())]
            lg = logits[chosen].clone()
            for t in st["history"].get(chosen, ()):
                lg[t] = float("-inf")
            x[chosen] = lg.argmax()
    st["seen"].add(tuple(old))
    for pos in transfer.nonzero().view(-1).tolist():
        st["history"].setdefault(pos, set()).add(int(x[pos]))
    block[transfer] = x[transfer]
    if ((block == delete_id) | (block == split_id)).any():
        new, flags = _edit_ops(block.tolist(), old, st["is_orig_mask"], mask_id, delete_id, split_id, len(old))
        block = torch.tensor(new)
        st["is_orig_mask"] = flags
    return force, block


@torch.no_grad()
def reference_indel_generate(forward, prompt, *, mask_id, delete_id, split_id, eos_id, gen_length, block_length,
                             threshold=0.5, edit_threshold=0.0, max_post_edit_steps=16):
    """(canvas [1, whole blocks], number of forwards). `forward(tokens, position_ids, block_length)` → logits."""
    plen = prompt.shape[1]
    n_blocks = -(-(plen + gen_length) // block_length)
    x = torch.full((1, n_blocks * block_length), mask_id, dtype=torch.long)
    x[0, :plen] = prompt[0]
    n_forwards = 0
    for b in range(plen // block_length, n_blocks):
        lo, hi = b * block_length, (b + 1) * block_length
        if not (x[0, lo:hi] == mask_id).any():
            continue
        st = {"prompt_mask": x[0, lo:hi] != mask_id, "is_orig_mask": (x[0, lo:hi] == mask_id).tolist(),
              "post_edit_steps": 0, "seen": set(), "history": {}}
        for _ in range(block_length + max_post_edit_steps + 1):
            logits = forward(x[:, :hi], torch.arange(hi)[None], block_length)[0, lo:hi].float()
            n_forwards += 1
            done, block = _step(logits, x[0, lo:hi].clone(), st, mask_id=mask_id, delete_id=delete_id,
                                split_id=split_id, threshold=threshold, edit_threshold=edit_threshold,
                                max_post=max_post_edit_steps)
            x[0, lo:hi] = block
            if done:
                break
        if eos_id is not None and (x[0, plen:hi] == eos_id).any():
            break
    return x, n_forwards
