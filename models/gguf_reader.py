"""GGUF v2/v3 header reader: metadata, tensor table, dequantized tensor reads.

Parsed here (the GGUF layout: magic, version, counts, key/values, tensor infos, aligned data)
rather than with `gguf.GGUFReader`: that reader walks 100k-entry vocabularies one numpy view at a
time (seconds for SmolLM2) and raises bare ValueErrors on damaged files; this one reads SmolLM2's
header in ~0.1 s and names the exact problem (truncation point, unknown type id, ...).
Dequantization is `gguf.quants.dequantize` (numpy).
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import os
import struct
from collections.abc import Mapping
from typing import Any

import gguf
import jax.numpy as jnp
import numpy as np

from specjax.models.checkpoint import CheckpointError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

_SCALAR_FORMATS = {
    gguf.GGUFValueType.UINT8: "<B",
    gguf.GGUFValueType.INT8: "<b",
    gguf.GGUFValueType.UINT16: "<H",
    gguf.GGUFValueType.INT16: "<h",
    gguf.GGUFValueType.UINT32: "<I",
    gguf.GGUFValueType.INT32: "<i",
    gguf.GGUFValueType.UINT64: "<Q",
    gguf.GGUFValueType.INT64: "<q",
    gguf.GGUFValueType.FLOAT32: "<f",
    gguf.GGUFValueType.FLOAT64: "<d",
    gguf.GGUFValueType.BOOL: "<?",
}


@dataclasses.dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order: reversed ggml `ne` (rows first, row length last)
    qtype: gguf.GGMLQuantizationType
    offset: int  # absolute byte offset of the data in the file
    nbytes: int


@dataclasses.dataclass(frozen=True, eq=False)
class GGUFFile:
    """A parsed GGUF header plus a read-only mapping of the file for the tensor data."""

    path: str
    version: int
    metadata: Mapping[str, Any]  # numeric arrays as numpy arrays, string arrays as lists
    tensors: Mapping[str, GGUFTensorInfo]
    buffer: Any  # mmap.mmap of the whole file

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def read(self, name: str) -> np.ndarray:
        """Tensor `name` as floats (f32; F16 stays f16), numpy shape (see GGUFTensorInfo.shape)."""
        info = self.tensors[name]
        raw = np.frombuffer(self.buffer, np.uint8, info.nbytes, info.offset)
        if info.qtype == gguf.GGMLQuantizationType.F32:
            return raw.view(np.float32).reshape(info.shape)
        if info.qtype == gguf.GGMLQuantizationType.F16:
            return raw.view(np.float16).reshape(info.shape)
        byte_shape = gguf.quants.quant_shape_to_byte_shape(info.shape, info.qtype)
        try:
            return gguf.quants.dequantize(raw.reshape(byte_shape), info.qtype)
        except NotImplementedError:
            raise CheckpointError(
                self.path,
                f"tensor {name!r} uses quantization type {info.qtype.name}, which cannot be "
                "dequantized (gguf.quants supports F32, F16, BF16, Q4_0..Q8_0, the K-quants, IQ*)",
            ) from None

    def read_blocks(self, name: str, mode: str) -> tuple[np.ndarray, np.ndarray] | None:
        """Tensor `name` as (values, block scales) (`block_values`) when it is stored in the
        block type that quantization `mode` holds exactly (`EXACT_BLOCKS`), else None."""
        info = self.tensors[name]
        if EXACT_BLOCKS.get(mode) != info.qtype or len(info.shape) != 2:
            return None
        raw = np.frombuffer(self.buffer, np.uint8, info.nbytes, info.offset)
        return block_values(raw, info.qtype, info.shape)


#: GGUF block types a qwix QArray holds exactly (value = d * q, f16 d per 32 values of a row),
#: by the quantization mode they serve: Q8_0 int8 q, Q4_0 nibbles - 8 (int4)
EXACT_BLOCKS = {"int8": gguf.GGMLQuantizationType.Q8_0, "int4": gguf.GGMLQuantizationType.Q4_0}
QUANT_BLOCK = 32


def block_values(raw: np.ndarray, qtype, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(values `[rows, cols]` int8 / int4, scales `[rows, cols / 32]` f32) of Q8_0 / Q4_0 bytes
    `raw` of a tensor of numpy `shape` (rows, cols): `values * repeat(scales, 32)` is exactly
    what `gguf.quants.dequantize` gives."""
    rows, cols = shape
    block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    blocks = raw.reshape(rows, cols // QUANT_BLOCK, block_bytes)
    scales = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    payload = blocks[..., 2:]
    if qtype == gguf.GGMLQuantizationType.Q8_0:
        values = payload.copy().view(np.int8)
    else:  # Q4_0: byte j holds values j (low nibble) and j + 16 (high nibble)
        nibbles = np.concatenate([payload & 0x0F, payload >> 4], axis=-1)
        values = (nibbles.astype(np.int8) - 8).astype(jnp.int4)
    return values.reshape(rows, cols), scales


class _Cursor:
    """Little-endian reads over the mapped file; running past its end is a truncation error."""

    def __init__(self, buffer, path: str):
        self.buffer, self.path, self.pos = buffer, path, 0

    def _need(self, size: int, what: str) -> None:
        if self.pos + size > len(self.buffer):
            raise CheckpointError(
                self.path,
                f"truncated file: the header ends inside {what} (needs byte {self.pos + size}, "
                f"the file has {len(self.buffer)})",
            )

    def scalar(self, fmt: str, what: str):
        size = struct.calcsize(fmt)
        self._need(size, what)
        (value,) = struct.unpack_from(fmt, self.buffer, self.pos)
        self.pos += size
        return value

    def string(self, what: str) -> str:
        size = self.scalar("<Q", what)
        self._need(size, what)
        raw = self.buffer[self.pos : self.pos + size]
        self.pos += size
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int, what: str) -> Any:
        if vtype == gguf.GGUFValueType.STRING:
            return self.string(what)
        if vtype == gguf.GGUFValueType.ARRAY:
            return self.array(what)
        if vtype not in _SCALAR_FORMATS:
            raise CheckpointError(
                self.path, f"corrupt header: unknown value type {vtype} in {what}"
            )
        return self.scalar(_SCALAR_FORMATS[vtype], what)

    def array(self, what: str) -> Any:
        item_type = self.scalar("<I", what)
        count = self.scalar("<Q", what)
        if item_type in _SCALAR_FORMATS:
            dtype = np.dtype(_SCALAR_FORMATS[item_type])
            self._need(count * dtype.itemsize, what)
            out = np.frombuffer(self.buffer, dtype, count, self.pos).copy()
            self.pos += count * dtype.itemsize
            return out
        return [self.value(item_type, what) for _ in range(count)]


def _tensor_info(
    cursor: _Cursor, path: str
) -> tuple[str, tuple[int, ...], gguf.GGMLQuantizationType, int]:
    name = cursor.string("a tensor name")
    n_dims = cursor.scalar("<I", f"tensor {name!r}")
    ne = [cursor.scalar("<Q", f"tensor {name!r}") for _ in range(n_dims)]
    raw_type = cursor.scalar("<I", f"tensor {name!r}")
    offset = cursor.scalar("<Q", f"tensor {name!r}")
    try:
        qtype = gguf.GGMLQuantizationType(raw_type)
    except ValueError:
        raise CheckpointError(
            path, f"tensor {name!r} has unknown quantization type id {raw_type}"
        ) from None
    return name, tuple(reversed(ne)), qtype, offset


def _tensor_nbytes(path: str, name: str, shape: tuple[int, ...], qtype) -> int:
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if shape and shape[-1] % block:
        raise CheckpointError(
            path,
            f"tensor {name!r}: row length {shape[-1]} is not a multiple of the "
            f"{qtype.name} block size {block}",
        )
    return math.prod(shape) // block * type_size


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parses the header of a GGUF v2/v3 file; tensor data stays mapped, read on demand."""
    path = str(path)
    try:
        with open(path, "rb") as f:
            buffer = (
                mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if os.path.getsize(path) else b""
            )
    except OSError as e:
        raise CheckpointError(path, f"cannot open: {e.strerror or e}") from None
    if buffer[:4] != GGUF_MAGIC:
        raise CheckpointError(
            path, f"not a GGUF file (starts with {bytes(buffer[:4])!r}, expected b'GGUF')"
        )
    cursor = _Cursor(buffer, path)
    cursor.pos = 4
    version = cursor.scalar("<I", "the version")
    if version not in (2, 3):
        raise CheckpointError(path, f"unsupported GGUF version {version} (2 and 3 are supported)")
    n_tensors = cursor.scalar("<Q", "the tensor count")
    n_kv = cursor.scalar("<Q", "the metadata count")
    metadata = {}
    for _ in range(n_kv):
        key = cursor.string("a metadata key")
        metadata[key] = cursor.value(cursor.scalar("<I", f"metadata {key!r}"), f"metadata {key!r}")
    infos = [_tensor_info(cursor, path) for _ in range(n_tensors)]
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    data_start = -(-cursor.pos // alignment) * alignment
    tensors = {}
    for name, shape, qtype, rel in infos:
        nbytes = _tensor_nbytes(path, name, shape, qtype)
        start = data_start + rel
        if start + nbytes > len(buffer):
            raise CheckpointError(
                path,
                f"truncated file: tensor {name!r} needs bytes [{start}, {start + nbytes}) "
                f"but the file has {len(buffer)}",
            )
        tensors[name] = GGUFTensorInfo(name, shape, qtype, start, nbytes)
    return GGUFFile(path, version, metadata, tensors, buffer)
