"""LLaDA2.2 on the LLaDA2.x loader: the InDel edit tokens are read from config.json (both, in the vocabulary,
distinct), and a checkpoint that says it is LLaDA2.2 (its name, or a block-routing key) is refused naming the
facts that are missing, rather than loaded with LLaDA2.0's token-wise routing."""

from __future__ import annotations

import pytest

from mdm_lens import HookedMDM
from mdm_lens.errors import ConfigError
from tests.families.family_checkpoints import write_llada2


def test_edit_tokens_are_read_from_config(tmp_path):
    folder, _, _ = write_llada2(tmp_path / "edit", delete_token_id=96, split_token_id=97)
    model = HookedMDM.from_pretrained(str(folder))
    assert (model.cfg.extra["delete_token_id"], model.cfg.extra["split_token_id"]) == (96, 97)
    plain, _, _ = write_llada2(tmp_path / "plain")
    assert "delete_token_id" not in HookedMDM.from_pretrained(str(plain)).cfg.extra


@pytest.mark.parametrize("overrides, match", [
    (dict(delete_token_id=96), "no split_token_id"),
    (dict(split_token_id=97), "no delete_token_id"),
    (dict(delete_token_id=96, split_token_id=96), "differ"),
    (dict(delete_token_id=96, split_token_id=10_000), "split_token_id=10000"),
    (dict(delete_token_id="96", split_token_id=97), "delete_token_id"),
])
def test_bad_edit_tokens_are_refused(tmp_path, overrides, match):
    folder, _, _ = write_llada2(tmp_path / "bad", **overrides)
    with pytest.raises(ConfigError, match=match):
        HookedMDM.from_pretrained(str(folder))


@pytest.mark.parametrize("where", ["name", "key"])
def test_a_llada22_checkpoint_is_refused_naming_the_missing_facts(tmp_path, where):
    if where == "name":
        folder, _, _ = write_llada2(tmp_path / "LLaDA2.2-mini-tiny", delete_token_id=96, split_token_id=97)
    else:
        folder, _, _ = write_llada2(tmp_path / "x", block_routing_capacity=6)
    with pytest.raises(ConfigError, match="block routing.*admission pool size C.*128K") as info:
        HookedMDM.from_pretrained(str(folder))
    assert ("LLaDA2.2-mini-tiny" if where == "name" else "block_routing_capacity") in str(info.value)
