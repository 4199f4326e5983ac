"""A lazy GGUF reader: header, metadata and tensor table, with the tensor data memory-mapped.

``gguf.GGUFReader`` builds Python objects for every element of every metadata array (a
262,144-entry vocabulary is three such arrays), which took most of a model's load time. Here
numeric arrays become one ``numpy.frombuffer`` each, and string arrays (tokens, merges) are
only walked, and decoded, when someone asks for them. Tensor data is never copied: each
tensor is a view of one ``numpy.memmap`` of the file.

Format (GGUF v2/v3, little-endian): magic ``GGUF``, version, tensor count, metadata count;
the metadata key/value pairs; the tensor infos (name, dims, type, offset); then the data,
aligned to ``general.alignment`` (32 by default).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edge_rtgi.errors import ModelFileError

# GGUF metadata value types.
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL, _STRING, _ARRAY = range(10)
_UINT64, _INT64, _FLOAT64 = 10, 11, 12
_SCALARS = {
    _UINT8: "<B",
    _INT8: "<b",
    _UINT16: "<H",
    _INT16: "<h",
    _UINT32: "<I",
    _INT32: "<i",
    _FLOAT32: "<f",
    _BOOL: "<?",
    _UINT64: "<Q",
    _INT64: "<q",
    _FLOAT64: "<d",
}
_NUMPY = {t: np.dtype(f) for t, f in _SCALARS.items()}


@dataclass(frozen=True)
class StringArray:
    """A metadata array of strings, left undecoded until ``list()`` (or iteration) asks."""

    buffer: memoryview  # the whole file (a view of the uint8 memmap)
    offset: int  # first length prefix
    count: int

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[str]:
        raw, pos = self.buffer, self.offset
        for _ in range(self.count):
            (n,) = struct.unpack_from("<Q", raw, pos)
            yield bytes(raw[pos + 8 : pos + 8 + n]).decode("utf-8", errors="replace")
            pos += 8 + n


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor: GGUF dims (innermost first), GGML type id, and its raw bytes (a memmap view)."""

    name: str
    dims: tuple[int, ...]
    type_id: int
    data: np.ndarray  # uint8, the tensor's bytes in the file

    @property
    def type_name(self) -> str:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self.type_id).name

    @property
    def shape(self) -> tuple[int, ...]:
        """The PyTorch shape (outermost first)."""
        return tuple(reversed(self.dims))


@dataclass
class GGUFFile:
    """The parsed header of a GGUF file; see the module docstring."""

    path: Path
    version: int
    metadata: dict[str, Any]  # scalars, numpy arrays, or StringArray
    tensors: dict[str, GGUFTensorInfo]

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def strings(self, key: str) -> list[str] | None:
        """A string array decoded to a list (None when absent)."""
        value = self.metadata.get(key)
        return None if value is None else list(value)


class _Cursor:
    def __init__(self, raw: np.ndarray, path: Path):
        self.array, self.raw, self.pos, self.path = raw, raw.data, 0, path

    def scalar(self, fmt: str) -> Any:
        try:
            (value,) = struct.unpack_from(fmt, self.raw, self.pos)
        except struct.error:
            raise ModelFileError(
                f"{self.path} is truncated or corrupt (at byte {self.pos})", hint="re-download the model"
            ) from None
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        if self.pos + n > len(self.raw):
            raise ModelFileError(
                f"{self.path} is truncated or corrupt (a string at byte {self.pos})",
                hint="re-download the model",
            )
        text = bytes(self.raw[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return text

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise ModelFileError(f"{self.path}: unknown metadata type {kind} at byte {self.pos}")
        elem, count = self.scalar("<I"), self.scalar("<Q")
        if elem in _NUMPY:
            size = _NUMPY[elem].itemsize * count
            if self.pos + size > len(self.raw):
                raise ModelFileError(f"{self.path} is truncated or corrupt (an array at byte {self.pos})")
            out = np.frombuffer(self.array, _NUMPY[elem], count, self.pos)
            self.pos += size
            return out
        if elem == _STRING:
            start = self.pos
            for _ in range(count):  # walk the length prefixes only
                self.pos += 8 + self.scalar("<Q")
            if self.pos > len(self.raw):
                raise ModelFileError(f"{self.path} is truncated or corrupt (a string array at byte {start})")
            return StringArray(self.raw, start, count)
        return [self.value(elem) for _ in range(count)]  # nested arrays: rare and small


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse a GGUF file's header; ModelFileError for anything that is not a readable GGUF."""
    path = Path(path)
    try:
        raw = np.memmap(path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as exc:
        raise ModelFileError(f"cannot open {path}: {exc}") from None
    if len(raw) < 24 or bytes(raw[:4]) != b"GGUF":
        raise ModelFileError(
            f"{path} is neither a GGUF file nor an HF model folder (magic {bytes(raw[:4])!r})",
            hint="pass a .gguf file or a folder with config.json and *.safetensors",
        )
    cur = _Cursor(raw, path)
    cur.pos = 4
    version = cur.scalar("<I")
    if version not in (2, 3):
        raise ModelFileError(f"{path}: GGUF version {version} is not supported (2 or 3)")
    num_tensors, num_kv = cur.scalar("<Q"), cur.scalar("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(num_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.scalar("<I"))
    infos = []
    for _ in range(num_tensors):
        name = cur.string()
        dims = tuple(cur.scalar("<Q") for _ in range(cur.scalar("<I")))
        infos.append((name, dims, cur.scalar("<I"), cur.scalar("<Q")))
    alignment = int(metadata.get("general.alignment", 32))
    data_start = -(-cur.pos // alignment) * alignment
    tensors = {}
    for name, dims, type_id, offset in infos:
        nbytes = _nbytes(type_id, dims, path, name)
        start = data_start + offset
        if start + nbytes > len(raw):
            raise ModelFileError(
                f"{path} is truncated or corrupt: tensor {name} ends past the end of the file",
                hint="re-download the model",
            )
        tensors[name] = GGUFTensorInfo(name, dims, type_id, raw[start : start + nbytes])
    return GGUFFile(path, version, metadata, tensors)


def _nbytes(type_id: int, dims: tuple[int, ...], path: Path, name: str) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
    except (ValueError, KeyError):
        raise ModelFileError(f"{path}: tensor {name} has unknown GGML type {type_id}") from None
    count = int(np.prod(dims, dtype=np.int64)) if dims else 1
    return count // block * type_size


def dequantize(tensor: GGUFTensorInfo) -> np.ndarray:
    """The tensor's values as float32, in PyTorch's shape (``gguf.quants`` does the blocks)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    kind = GGMLQuantizationType(tensor.type_id)
    if kind == GGMLQuantizationType.F32:
        return tensor.data.view(np.float32).reshape(tensor.shape)
    if kind == GGMLQuantizationType.F16:
        return tensor.data.view(np.float16).astype(np.float32).reshape(tensor.shape)
    flat = gguf_dequantize(tensor.data, kind)
    return np.asarray(flat, dtype=np.float32).reshape(tensor.shape)


def q4k_grid(tensor: GGUFTensorInfo) -> tuple[np.ndarray, np.ndarray]:
    """A Q4_K tensor's grid per 32 weights: (scale, min) [N, K/32] float32, with w = scale * q - min
    for its 4-bit codes q (each 256-weight block holds 8 such groups, 6-bit scales and mins)."""
    from gguf.quants import Q4_K

    if tensor.type_name != "Q4_K":
        raise ValueError(f"{tensor.name} is {tensor.type_name}, not Q4_K")
    blocks = tensor.data.reshape(-1, 144)
    d = blocks[:, 0:2].view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16])
    rows = tensor.shape[0]
    return (d * sc.astype(np.float32)).reshape(rows, -1), (dmin * m.astype(np.float32)).reshape(rows, -1)


def scalar_metadata(gguf: GGUFFile) -> Mapping[str, Any]:
    """The metadata without its arrays (what a config needs; cheap to copy and log)."""
    return {k: v for k, v in gguf.metadata.items() if not isinstance(v, (np.ndarray, StringArray, list))}
