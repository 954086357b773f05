"""`mdm-lens sweep` on each 2026 family's tiny checkpoint (a folder in its hub layout, with a character-level tokenizer
so the zoo items render; the short `zoo` template, a short canvas): every probe on LLaDA2 (block-causal), and
`mdm-lens report` on that folder; on SDAR and LLaDA-MoE the probes whose code path differs for them."""

from __future__ import annotations

import json
import string

import pandas as pd
import pytest
import torch
from family_checkpoints import write_llada2, write_lladamoe, write_sdar
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from mdm_lens.cli import main

PROBES = "accuracy,absorption,temporal,qk,retrieval,flow,knockout,lens,cache,features"
FAMILY_PROBES = {
    # block-causal, one uncached forward per step: every probe runs here, and the report is built on this sweep
    "llada2": PROBES + ",atp",
    # KV-cached block forwards: the probes that read what the sampler's forwards saw (the generation, attention
    # recorded on the cached rows, knockout's cache-detached pre-pass, the lens on replayed rows, the cache table,
    # residual features, retrieval's TopKKeys records on the cached rows: test_family_patch.py checks them against
    # the replay). qk / flow run the same plain block-mask forward of the final sequence as on LLaDA2
    "sdar": "accuracy,absorption,temporal,retrieval,knockout,lens,cache,features,atp",
    # bidirectional MoE through the llada sampler: the generation, attention hooks and the KV-cached run (cache)
    # through the MoE blocks; the rest is LLaDA's code path, swept on LLaDA in tests/test_sweep.py
    "lladamoe": "accuracy,temporal,cache",
}
ITEMS = [{"id": "a", "question": "ab?", "passages": [{"segment": "x is ab."}, {"segment": "ab is cd."}],
          "answers": ["cd"], "gold_index": 1},
         {"id": "b", "question": "ef?", "passages": [{"segment": "ef is gh."}, {"segment": "y is z."}],
          "answers": ["gh"], "gold_index": 0}]
WRITERS = {"llada2": write_llada2, "sdar": write_sdar, "lladamoe": write_lladamoe}


def _char_tokenizer(folder) -> None:
    """95 printable characters (ids 0..94) and the checkpoints' special ids (eos 98, pad 99, mask 100)."""
    chars = sorted(set(string.printable) - set("\t\n\r\x0b\x0c"))
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({"[UNK]": 95, "<bos>": 96, "<eot>": 97, "<|eos|>": 98, "<|pad|>": 99, "<|mask|>": 100})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.save(str(folder / "tokenizer.json"))


@pytest.mark.parametrize("family", ["llada2", "sdar", "lladamoe"])
def test_sweep_runs_on_the_family(tmp_path, family):
    folder = WRITERS[family](tmp_path / "ckpt")[0]
    _char_tokenizer(folder)
    data = tmp_path / "items.jsonl"  # short items: a character tokenizer makes every letter a position
    data.write_text("\n".join(json.dumps(item) for item in ITEMS) + "\n")
    out = tmp_path / "sweep"
    probes = FAMILY_PROBES[family]
    n = 2 if family == "llada2" else 1  # two items where the report is built (it compares items), one elsewhere
    assert main(["sweep", "--model", str(folder), "--data", str(data), "--probes", probes, "--out", str(out),
                 "--limit", str(n), "--gen-length", "4", "--steps", "2", "--block-length", "4", "--template", "zoo",
                 "--no-progress"]) == 0
    for probe in probes.split(","):
        table = pd.read_parquet(out / f"{probe}.parquet")
        assert len(table) > 0, probe
        if "item_id" in table:
            assert set(table["item_id"]) == set("ab"[:n]), probe
    if family == "llada2":
        assert main(["report", str(out)]) == 0
        assert (out / "report").is_dir() and any((out / "report").iterdir())


def test_every_probe_runs_on_a_block_causal_family():
    from mdm_lens.sweep.adapter import PROBES as ALL  # the sweep's own list: a new probe must be swept here too

    assert set(FAMILY_PROBES["llada2"].split(",")) == set(ALL)


def test_a_sweeps_block_length_is_the_mask_of_its_clean_forwards(tmp_path, monkeypatch):
    """`--block-length 4` on LLaDA2 (checkpoint default 32): the final-sequence forward behind absorption / flow
    sees blocks of 4 (a query of block 0 gives keys of block 1 exactly 0), as the sampler's forwards did; the
    model's default is restored after the sweep."""
    from mdm_lens import HookedMDM
    from mdm_lens.probes import run as R

    folder = write_llada2(tmp_path / "ckpt")[0]
    _char_tokenizer(folder)
    data = tmp_path / "items.jsonl"
    data.write_text(json.dumps(ITEMS[0]) + "\n")
    model = HookedMDM.from_pretrained(str(folder))
    default = model.cfg.extra["block_length"]
    assert default > 8
    seen = []
    real = R.final_attention

    def spy(*args, **kwargs):
        seen.append(real(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(R, "final_attention", spy)
    from mdm_lens.sweep.runner import run
    run(model, data, "absorption", tmp_path / "sweep", limit=1, gen_length=4, steps=2, block_length=4,
        template="zoo", progress=False)
    assert seen and model.cfg.extra["block_length"] == default
    pattern = seen[0]                                               # [batch, layer, head, query, key]
    assert pattern.shape[-1] > 8
    assert torch.equal(pattern[..., :4, 4:], torch.zeros_like(pattern[..., :4, 4:]))
    assert bool((pattern[..., 4:8, :8].sum(-1) > 0.999).all())        # block 1 sees blocks 0 and 1
