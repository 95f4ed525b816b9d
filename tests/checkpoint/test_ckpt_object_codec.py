"""Framework objects in a flash checkpoint: rebuilt by an allow-list, never from any class."""

from __future__ import annotations

import argparse
from collections import namedtuple

import numpy as np
import pytest
import torch

from dlrover.checkpoint.errors import StateDictError
from dlrover.checkpoint.layout import plan_layout
from dlrover.checkpoint.object_codec import OBJECT_KEY, decode_objects, encode_objects


class _Unknown:
    """A class of no framework: a checkpoint may not name it."""


def test_sizes_arrays_and_namespaces_round_trip_through_a_storable_tree() -> None:
    rng = np.random.get_state()
    state = {
        "shape": torch.Size([2, 3]),
        "args": argparse.Namespace(lr=0.1, dtype=torch.bfloat16, layers=[1, 2]),
        "rng": rng,
        "t": torch.ones(2),
    }
    encoded = encode_objects(state)
    plan_layout(encoded)  # the segment layout takes every part of it
    decoded = decode_objects(encoded)
    assert type(decoded["shape"]) is torch.Size and decoded["shape"] == torch.Size([2, 3])
    assert vars(decoded["args"]) == {"lr": 0.1, "dtype": torch.bfloat16, "layers": [1, 2]}
    assert decoded["rng"][0] == rng[0] and np.array_equal(decoded["rng"][1], rng[1])
    assert decoded["rng"][1].dtype == rng[1].dtype
    assert decoded["t"] is state["t"]


def test_objects_of_other_classes_are_left_to_the_layout_which_names_them() -> None:
    encoded = encode_objects({"x": {"y": _Unknown()}})
    with pytest.raises(StateDictError, match=r"x\.y: a _Unknown cannot be stored"):
        plan_layout(encoded)


def test_a_checkpoint_naming_a_class_outside_the_allow_list_is_refused() -> None:
    for name in ("os:system", f"{__name__}:_Unknown", "subprocess:Popen"):
        with pytest.raises(StateDictError, match="not rebuilt from a checkpoint"):
            decode_objects({"a": {OBJECT_KEY: name, "attrs": {}}})


def test_named_tuples_of_other_classes_are_kept_as_plain_tuples() -> None:
    point = namedtuple("point", "x y")  # a local class: not importable, so not rebuilt
    assert decode_objects(encode_objects({"p": point(1, 2)})) == {"p": (1, 2)}


@pytest.mark.extras
def test_deepspeed_objects_round_trip() -> None:
    """An allowed package's object by its attributes (DeepSpeed's loss scaler, in every ZeRO
    optimizer state) and a dataclass (its fragment addresses)."""
    module = pytest.importorskip(
        "deepspeed.runtime.fp16.loss_scaler", reason="deepspeed is not installed"
    )
    from deepspeed.utils.tensor_fragment import fragment_address

    state = {"s": module.LossScaler(scale=4.0), "f": fragment_address(numel=3, start=5)}
    back = decode_objects(encode_objects(state))
    assert type(back["s"]) is type(state["s"]) and vars(back["s"]) == vars(state["s"])
    assert back["f"] == state["f"]
