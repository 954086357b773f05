"""Config values of the research DiT families (MDLM, Duo, BD3LM, GIDD) that would make a run silently wrong are
refused at load, naming the key: values inference does not read too (a dropout of 2.0, a reversed training-clock
interval), GIDD's t_eps at or above 0.5 (its time grid would run backwards), and a config whose `model_type` and
`architectures` name two different families."""

from __future__ import annotations

import pytest

from mdm_lens import HookedMDM
from mdm_lens.errors import ConfigError
from tests.families.bd3gidd_checkpoints import BD3LM_CONFIG, GIDD_CONFIG, write_bd3lm, write_gidd
from tests.families.ddit_checkpoints import DUO_CONFIG, MDLM_CONFIG, write_ddit

WRITERS = {"mdlm": (write_ddit, MDLM_CONFIG), "duo": (write_ddit, DUO_CONFIG), "bd3lm": (write_bd3lm, BD3LM_CONFIG),
           "gidd": (write_gidd, GIDD_CONFIG)}


def _load(tmp_path, family, **changes):
    write, config = WRITERS[family]
    config = {k: v for k, v in {**config, **changes}.items() if v is not None}
    folder = write(tmp_path / family, config) if write is not write_ddit else write_ddit(tmp_path / family, config)
    return HookedMDM.from_pretrained(str(folder[0]), load_tokenizer=False)


@pytest.mark.parametrize("family, key, value, allowed", [
    ("gidd", "t_eps", 0.5, "[0, 0.5)"), ("gidd", "t_eps", 0.7, "[0, 0.5)"), ("gidd", "t_eps", -1e-4, "[0, 0.5)"),
    ("gidd", "p_uniform", 1.0, "[0, 1)"), ("gidd", "attention_dropout", 1.5, "[0, 1)"),
    ("mdlm", "dropout", 2.0, "[0, 1)"), ("duo", "dropout", 1.0, "[0, 1)"), ("bd3lm", "dropout", 2.0, "[0, 1)"),
    ("bd3lm", "sampling_eps_max", 1.5, "[0, 1]"), ("bd3lm", "sampling_eps_min", -0.1, "[0, 1]"),
])
def test_a_value_out_of_its_range_is_refused_naming_the_key(tmp_path, family, key, value, allowed):
    with pytest.raises(ConfigError, match=rf"{key}={value!r} is invalid: expected a number in \{allowed[0]}"):
        _load(tmp_path, family, **{key: value})


def test_the_edges_that_are_allowed_load(tmp_path):
    assert _load(tmp_path / "a", "gidd", t_eps=0.49).cfg.extra["t_eps"] == 0.49
    assert _load(tmp_path / "b", "gidd", p_uniform=0.0).cfg.extra["p_uniform"] == 0.0
    cfg = _load(tmp_path / "c", "bd3lm", sampling_eps_min=0.3, sampling_eps_max=0.3).cfg
    assert (cfg.extra["sampling_eps_min"], cfg.extra["sampling_eps_max"]) == pytest.approx((0.3, 0.3))  # fp32 buffers
    assert _load(tmp_path / "d", "mdlm", dropout=0.0).cfg.extra["dropout"] == 0.0


def test_a_reversed_sampling_eps_interval_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="sampling_eps_min=0.9 is above sampling_eps_max=0.5"):
        _load(tmp_path, "bd3lm", sampling_eps_min=0.9, sampling_eps_max=0.5)


@pytest.mark.parametrize("family, model_type, architectures", [
    ("mdlm", "mdlm", ["DUO"]), ("duo", "duo", ["MDLM"]), ("mdlm", "bd3lm", ["MDLM"]), ("bd3lm", "bd3lm", ["DIT"]),
    ("gidd", "dit", ["BD3LM"]), ("bd3lm", "mdlm", ["BD3LM"]), ("mdlm", None, ["MDLM", "DUO"]),
])
def test_model_type_and_architectures_naming_two_families_are_refused(tmp_path, family, model_type, architectures):
    with pytest.raises(ConfigError, match="name different families") as err:
        _load(tmp_path, family, model_type=model_type, architectures=architectures)
    assert "model_type" in str(err.value) and "architectures" in str(err.value)


@pytest.mark.parametrize("family, model_type, architectures", [
    ("mdlm", "mdlm", None), ("mdlm", None, ["MDLM"]), ("duo", "duo", ["DUO"]), ("gidd", "dit", None),
    ("bd3lm", None, ["BD3LM"]),
])
def test_one_family_named_once_or_twice_loads_as_it(tmp_path, family, model_type, architectures):
    assert _load(tmp_path, family, model_type=model_type, architectures=architectures).cfg.family == family


@pytest.mark.parametrize("low, high, match", [(0.9, 0.5, "is above"), (float("nan"), 0.5, "sampling_eps_min=nan"),
                                              (0.1, 1.5, "sampling_eps_max=1.5")])
def test_the_weights_eps_buffers_which_override_config_are_checked_too(tmp_path, low, high, match):
    import torch
    from safetensors.torch import load_file, save_file

    folder, _ = write_bd3lm(tmp_path / "b")
    sd = load_file(str(folder / "model.safetensors"))
    sd["sampling_eps_min"], sd["sampling_eps_max"] = torch.tensor(low), torch.tensor(high)
    save_file(sd, str(folder / "model.safetensors"))
    with pytest.raises(ConfigError, match=match) as err:
        HookedMDM.from_pretrained(str(folder), load_tokenizer=False)
    assert "buffers" in str(err.value)
