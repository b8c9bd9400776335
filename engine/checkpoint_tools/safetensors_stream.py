"""A safetensors file written one tensor at a time, so the whole state dict is never in memory.

``safetensors.torch.save_file`` takes a finished dict. The format is simple enough to stream:
an 8-byte little-endian header length, a JSON header (dtype, shape and byte range of every
tensor, padded with spaces to a multiple of 8), then the tensors' bytes in header order. The
header is known before any tensor is produced (shapes and dtypes come from the plan), so each
tensor is written as soon as it has been joined and then dropped.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable
from typing import BinaryIO

import torch

from smp2ds.engine.exceptions import SMPUnsupportedError

DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


def header(entries: Iterable[tuple[str, tuple[int, ...], torch.dtype]],
           metadata: dict[str, str] | None = None) -> bytes:
    """The length-prefixed, padded JSON header for tensors ``(name, shape, dtype)`` in this order."""
    table: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, shape, dtype in entries:
        if dtype not in DTYPES:
            raise SMPUnsupportedError(f"tensor {name!r} has dtype {dtype}, which safetensors cannot store; "
                                      f"allowed: {', '.join(str(d) for d in DTYPES)} (use --format pt)")
        size = dtype.itemsize
        for extent in shape:
            size *= extent
        table[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(table, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


class StreamWriter:
    """Write ``header`` then tensors in the same order; :meth:`close` checks every byte arrived."""

    def __init__(self, path: str, entries: list[tuple[str, tuple[int, ...], torch.dtype]],
                 metadata: dict[str, str] | None = None):
        self.path, self._tmp = path, f"{path}.smp2ds-partial"
        self._expected = [(n, tuple(s), d) for n, s, d in entries]
        self._next = 0
        self._handle: BinaryIO = open(self._tmp, "wb")  # noqa: SIM115 -- closed in close()/abort()
        self._handle.write(header(self._expected, metadata))

    def write(self, name: str, tensor: torch.Tensor) -> None:
        want = self._expected[self._next]
        if (name, tuple(tensor.shape), tensor.dtype) != want:
            raise ValueError(f"tensor {name} {tuple(tensor.shape)} {tensor.dtype} written where the header "
                             f"announced {want}")
        data = tensor.detach().contiguous().view(-1).view(torch.uint8) if tensor.numel() else None
        if data is not None:
            self._handle.write(memoryview(data.numpy()))
        self._next += 1

    def close(self) -> None:
        """Finish the file: fsync and rename into place (a crash never leaves half a file under its name)."""
        if self._next != len(self._expected):
            self.abort()
            raise ValueError(f"{self.path}: {len(self._expected) - self._next} announced tensors were never written")
        self._handle.flush()
        os.fsync(self._handle.fileno())
        self._handle.close()
        os.replace(self._tmp, self.path)

    def abort(self) -> None:
        self._handle.close()
        if os.path.exists(self._tmp):
            os.unlink(self._tmp)
