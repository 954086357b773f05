"""The shared argument checks: exact messages, exact normalisation, typed errors."""

import math

import pytest
import torch

from mdm_lens import validate
from mdm_lens.errors import ArgumentError, ArgumentTypeError, NonFiniteError, OutOfRangeError


def test_index_normalises_negatives_and_refuses_out_of_range():
    assert validate.index(-1, 4, name="layer") == 3
    assert validate.index(-4, 4, name="layer") == 0
    assert validate.index(torch.tensor(2), 4, name="layer") == 2
    with pytest.raises(OutOfRangeError) as e:
        validate.index(4, 4, name="layer", what="layer")
    assert e.value.argument == "layer" and e.value.value == 4
    assert "layer=4" in str(e.value) and "[-4, 3]" in str(e.value)
    with pytest.raises(OutOfRangeError):
        validate.index(-5, 4, name="layer")
    for bad in (1.0, True, "1", None):
        with pytest.raises(ArgumentTypeError):
            validate.index(bad, 4, name="layer")


def test_indices_forms():
    assert validate.indices(None, 3, name="layers") == [0, 1, 2]
    assert validate.indices(2, 3, name="layers") == [2]
    assert validate.indices([0, -1], 3, name="layers") == [0, 2]
    assert validate.indices(range(1, 3), 3, name="layers") == [1, 2]
    assert validate.indices(slice(None, None, 2), 5, name="layers") == [0, 2, 4]
    assert validate.indices(torch.tensor([1, 0]), 3, name="layers") == [1, 0]
    with pytest.raises(OutOfRangeError) as e:
        validate.indices([0, 7], 4, name="layers", what="layer")
    assert e.value.argument == "layers[1]"
    with pytest.raises(OutOfRangeError):
        validate.indices([1, -3], 4, name="layers")        # the same layer twice
    assert validate.indices([1, -3], 4, name="layers", unique=False) == [1, 1]
    with pytest.raises(OutOfRangeError):
        validate.indices([], 4, name="layers")
    assert validate.indices([], 4, name="layers", allow_empty=True) == []
    with pytest.raises(ArgumentTypeError):
        validate.indices("0", 4, name="layers")
    with pytest.raises(ArgumentTypeError):
        validate.indices(torch.tensor([0.0]), 4, name="layers")


def test_integer_and_number():
    assert validate.integer(3, name="steps", min=1) == 3
    with pytest.raises(ArgumentTypeError, match=r"steps=4\.5"):
        validate.integer(4.5, name="steps")
    with pytest.raises(ArgumentTypeError):
        validate.integer("4", name="gen_length")
    with pytest.raises(ArgumentError, match=">= 1"):
        validate.integer(0, name="steps", min=1)
    assert validate.number(1, name="t", min=0) == 1.0
    assert validate.number(0.0, name="t", min=0) == 0.0
    with pytest.raises(ArgumentError, match=r"> 0"):
        validate.number(0.0, name="eps", min=0, min_open=True)
    with pytest.raises(ArgumentError, match="finite"):
        validate.number(math.nan, name="t")
    with pytest.raises(ArgumentError):
        validate.number(1.0, name="top_p", min=0, max=1, max_open=True)
    with pytest.raises(ArgumentTypeError):
        validate.number(True, name="t")


def test_choice_instances_boolean():
    assert validate.choice("mass", ("mass", "cumulative"), name="kind") == "mass"
    with pytest.raises(ArgumentError, match="'mass', 'cumulative'"):
        validate.choice("mas", ("mass", "cumulative"), name="kind")
    with pytest.raises(ArgumentError):
        validate.choice(True, (1, 2), name="x")              # True == 1 but is not an allowed value
    assert validate.instances([1, 2], int, name="record") == [1, 2]
    with pytest.raises(ArgumentTypeError, match=r"record=\[\.\.\.\]"):
        validate.instances(1, int, name="record")
    assert validate.instances(1, int, name="record", allow_single=True) == [1]
    with pytest.raises(ArgumentTypeError, match=r"record\[1\]"):
        validate.instances([1, "a"], int, name="record")
    with pytest.raises(ArgumentTypeError):
        validate.boolean(1, name="flag")


def test_tensor_checks():
    x = torch.zeros(2, 3)
    assert validate.tensor(x, name="p", ndim=2, shape=(2, None), dtype="float") is x
    with pytest.raises(ArgumentError, match=r"\[2, \*, 1\]"):
        validate.tensor(x, name="p", shape=(2, None, 1))
    with pytest.raises(ArgumentError, match="3 dimensions"):
        validate.tensor(x, name="p", ndim=3)
    with pytest.raises(ArgumentTypeError, match="bool"):
        validate.tensor(x, name="mask", dtype="bool")
    with pytest.raises(ArgumentError, match="non-empty"):
        validate.tensor(torch.zeros(0, 3), name="p")
    with pytest.raises(ArgumentTypeError):
        validate.tensor([1, 2], name="p")
    bad = torch.tensor([1.0, math.nan, math.inf])
    with pytest.raises(NonFiniteError, match="1 NaN and 1 inf of 3"):
        validate.tensor(bad, name="p", finite=True)
    assert validate.finite(bad, name="p", nan_policy="propagate") is bad
    with pytest.raises(ArgumentError):
        validate.same_shape(x, torch.zeros(3, 2), names=("pattern", "mask"))
