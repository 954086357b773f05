"""`mdm-lens sweep` with every probe, and `mdm-lens report` on its folder, on each 2026 family's tiny checkpoint
(a folder in its hub layout, with a character-level tokenizer so the zoo items render): 2 items, a short canvas."""

from __future__ import annotations

import string

import pandas as pd
import pytest
from family_checkpoints import write_llada2, write_lladamoe, write_sdar
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from mdm_lens.cli import main
from mdm_lens.zoo import jsonl

PROBES = "accuracy,absorption,temporal,qk,retrieval,flow,knockout,lens,cache,features"
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
def test_sweep_and_report_run_on_the_family(tmp_path, family):
    folder = WRITERS[family](tmp_path / "ckpt")[0]
    _char_tokenizer(folder)
    data = tmp_path / "items.jsonl"
    jsonl.export(data, 2, seed=0)
    out = tmp_path / "sweep"
    assert main(["sweep", "--model", str(folder), "--data", str(data), "--probes", PROBES, "--out", str(out),
                 "--limit", "2", "--gen-length", "4", "--steps", "4", "--block-length", "4", "--no-progress"]) == 0
    for probe in PROBES.split(","):
        table = pd.read_parquet(out / f"{probe}.parquet")
        assert len(table) > 0, probe
    acc = pd.read_parquet(out / "accuracy.parquet")
    assert acc["item_id"].nunique() == 2 if "item_id" in acc else len(acc) > 0
    assert main(["report", str(out)]) == 0
    assert (out / "report").is_dir() and any((out / "report").iterdir())
