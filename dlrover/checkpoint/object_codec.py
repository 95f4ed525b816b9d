"""Framework objects inside a checkpoint state (torch.Size, DeepSpeed's loss scaler) as trees."""

from __future__ import annotations

import enum
import importlib
from typing import Any

import torch

from dlrover.checkpoint.errors import StateDictError

OBJECT_KEY = "__dlrover_object__"
"""The key of a dict that stands for an object (its value: ``module:qualname`` of its class)."""

ALLOWED_MODULE_PREFIXES = ("deepspeed.", "megatron.")
"""Classes of these packages may be rebuilt from a checkpoint: the frameworks whose own files
hold such objects. Nothing else is imported on load (a checkpoint names no arbitrary code)."""

ALLOWED_CLASSES = frozenset({"torch:Size", "argparse:Namespace", "numpy:ndarray"})
"""Classes outside those packages that the frameworks' states hold."""


def _class_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _allowed(name: str) -> bool:
    module = name.partition(":")[0]
    return name in ALLOWED_CLASSES or module.startswith(ALLOWED_MODULE_PREFIXES)


def encode_objects(value: Any) -> Any:
    """``value`` with each allowed object replaced by a dict the segment layout stores: a
    ``torch.Size`` or a named tuple by its items, an enum member by its name, another object
    by its ``__dict__``. Tensors are not copied; containers are rebuilt (OrderedDict becomes
    dict). Anything else is left for the layout, which names its path if it cannot be stored."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, dict):
        if OBJECT_KEY in value:
            raise StateDictError(f"a state dict key may not be {OBJECT_KEY!r}")
        return {k: encode_objects(v) for k, v in value.items()}
    cls = type(value)
    if cls in (list, tuple):
        return cls(encode_objects(v) for v in value)
    if value is None or cls in (bool, int, float, str) or isinstance(value, torch.dtype):
        return value
    name = _class_name(cls)
    if name == "numpy:ndarray":  # numpy's RNG state (Megatron-LM's rng_state): as a tensor
        return {OBJECT_KEY: name, "tensor": torch.from_numpy(value.copy())}
    if not _allowed(name):
        return value
    if isinstance(value, enum.Enum):
        return {OBJECT_KEY: name, "member": value.name}
    if isinstance(value, tuple):  # torch.Size, named tuples
        return {OBJECT_KEY: name, "items": [encode_objects(v) for v in value]}
    if hasattr(value, "__dict__"):
        return {OBJECT_KEY: name, "attrs": encode_objects(dict(vars(value)))}
    return value


def decode_objects(value: Any) -> Any:
    """The inverse of ``encode_objects``: each object dict rebuilt as its class (imported by
    name, only from the allowed ones; StateDictError for any other)."""
    if isinstance(value, dict):
        name = value.get(OBJECT_KEY)
        if name is None:
            return {k: decode_objects(v) for k, v in value.items()}
        return _rebuild(str(name), value)
    if type(value) in (list, tuple):
        return type(value)(decode_objects(v) for v in value)
    return value


def _rebuild(name: str, doc: dict[str, Any]) -> Any:
    if not _allowed(name):
        raise StateDictError(
            f"the checkpoint holds an object of class {name}, which is not rebuilt from a "
            f"checkpoint (allowed: {sorted(ALLOWED_CLASSES)} and classes of "
            f"{', '.join(ALLOWED_MODULE_PREFIXES)})"
        )
    module, _, qualname = name.partition(":")
    cls: Any = importlib.import_module(module)
    for part in qualname.split("."):
        cls = getattr(cls, part)
    if "tensor" in doc:
        return doc["tensor"].numpy()
    if "member" in doc:
        return cls[doc["member"]]
    if "items" in doc:
        items = [decode_objects(v) for v in doc["items"]]
        return cls(*items) if hasattr(cls, "_fields") else cls(items)
    obj = cls.__new__(cls)
    obj.__dict__.update(decode_objects(doc["attrs"]))
    return obj
