"""A rank's load of its step straight from a peer node's memory into its tensors (no local copy)."""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from dlrover.checkpoint.errors import SegmentStateError
from dlrover.checkpoint.layout import dtype_from_name, local_part, rebuild
from dlrover.checkpoint.replica import read_image

# Why this path exists: a replaced node used to copy the peer's image into new shared memory
# (allocating and zeroing as many pages) and then copy it again into the model. Here the bytes
# go from the socket into the tensors they end up in: one copy, as a push costs.


def load_from_peer(
    addr: str, token: str, key: str, step: int, target: Any = None
) -> tuple[int, Any, dict[str, Any]]:
    """(step, state, metadata) of image ``key`` at the peer ``addr``, which must hold ``step``.

    Each tensor is received straight into the matching tensor of ``target`` (same path, shape
    and dtype, on the CPU and contiguous), else into a fresh tensor (and, for a matching target
    tensor that cannot take bytes directly, copied into it after the transfer). Raises
    SegmentStateError when the peer does not hold the step, the transfer breaks off or the
    peer's image changed while it was sent: the target may then hold a mix of steps, so the
    caller must load it again from elsewhere (the checkpointers go to storage).
    """
    late: list[tuple[torch.Tensor, torch.Tensor]] = []  # (received, the target tensor)
    into: dict[int, torch.Tensor] = {}  # tensor index -> where its bytes are received

    def place(index: int, entry: dict[str, Any], tgt: Any) -> Any:
        shape, dtype = torch.Size(entry["shape"]), dtype_from_name(entry["dtype"])
        dest = local_part(tgt)
        if isinstance(dest, torch.Tensor) and dest.shape == shape and dest.dtype == dtype:
            if dest.device.type == "cpu" and dest.is_contiguous():
                into[index] = dest
            else:
                into[index] = torch.empty(shape, dtype=dtype)
                late.append((into[index], dest))
            return tgt
        into[index] = torch.empty(shape, dtype=dtype)
        return into[index]

    try:
        with read_image(addr, token, key, step) as image:
            meta = image.meta
            if int(meta.get("step", -1)) != step:
                raise SegmentStateError(f"peer {addr} sent step {meta.get('step')} for {step}")
            state = rebuild(meta, target, place)
            entries = meta["tensors"]
            for index in sorted(into, key=lambda i: int(entries[i]["offset"])):
                image.skip_to(int(entries[index]["offset"]))
                image.readinto(_bytes_of(into[index]))
            if not image.intact():
                raise SegmentStateError(f"the image of step {step} at {addr} changed while sent")
    except SegmentStateError:
        raise
    except Exception as exc:  # ReplicaError, a malformed image: the caller loads elsewhere
        raise SegmentStateError(
            f"loading step {step} from the peer at {addr} failed: {exc}"
        ) from exc
    with torch.no_grad():
        for received, dest in late:
            dest.copy_(received)
    return step, state, meta


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The writable bytes of a contiguous CPU tensor (the socket writes into them)."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())).cast("B")
