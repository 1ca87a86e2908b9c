"""Read GGUF files: llama.cpp's single-file format of metadata, tensor infos and tensor data.

A GGUF file is, all little-endian: the magic ``GGUF``, a version (2 or 3), the tensor count
and the metadata count (uint64 each); then the metadata, each a key (a string: uint64 length,
UTF-8 bytes), a value type (uint32) and the value (one of twelve scalar types, a string, or
an array: element type, uint64 count, elements); then one info per tensor (its name, the
number of dimensions, each dimension as uint64 -- *fastest-varying first*, ggml's ``ne``
order, so a ``(rows, columns)`` matrix is stored as ``[columns, rows]`` -- the ggml type and
its byte offset in the data section); then padding to ``general.alignment`` (32 unless the
metadata says otherwise), and the data section, every tensor's offset aligned the same way.

Why mie parses it here rather than with ``gguf.GGUFReader`` (llama.cpp's own Python reader,
which the tests use as the oracle for what a well-formed file holds): that reader trusts the
counts it reads. An array that declares more elements than the file has comes back short
without an error, a tensor whose offset points past the end fails with NumPy's reshape error
naming no tensor, and its errors are whatever Python raises (``IndexError``, ``KeyError``,
``UnicodeDecodeError``). A model file is input from anywhere, so this reader holds GGUF to
the standard of mie's safetensors reader (``mie.checkpoint``): every count is checked against
the bytes left before anything is allocated or looped over, so a hostile file costs at most
its own size in work; every tensor's shape, type, byte range and alignment is checked, and
no two tensors overlap; and every problem is a ``CheckpointError`` naming the file and the
key or tensor. The ``gguf`` package still supplies what is llama.cpp's to define: the type
numbers and block sizes (``GGML_QUANT_SIZES``) and, in ``mie.model.gguf_weights``, the
dequantizers of the block formats mie does not hold itself.

Tensor data is memory-mapped; ``raw`` gives one tensor's bytes as a read-only view, shaped
``(rows, bytes per row)`` for block formats and as NumPy shapes it (slowest dimension first)
for plain ones.
"""

from __future__ import annotations

import math
import os
import struct

import gguf
import numpy as np

from mie.checkpoint import MAX_BYTES, CheckpointError
from mie.checks import short_repr as _short

MAGIC = b"GGUF"
VERSIONS = (2, 3)
"""The versions whose layout this reader knows (1 had 32-bit counts; llama.cpp reads 2 and 3)."""

DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
"""ggml tensors have at most four dimensions (``GGML_MAX_DIMS``)."""

MAX_ARRAY_DEPTH = 8
"""Deepest nesting of arrays accepted (real files nest at most one level: arrays of arrays
of token ids); a bound so that a file of nested empty arrays cannot exhaust the stack."""

MAX_KEY_BYTES = 65536
"""Longest metadata key or tensor name accepted; real ones are a few dozen bytes."""

SCALARS = {
    gguf.GGUFValueType.UINT8: "<B",
    gguf.GGUFValueType.INT8: "<b",
    gguf.GGUFValueType.UINT16: "<H",
    gguf.GGUFValueType.INT16: "<h",
    gguf.GGUFValueType.UINT32: "<I",
    gguf.GGUFValueType.INT32: "<i",
    gguf.GGUFValueType.FLOAT32: "<f",
    gguf.GGUFValueType.BOOL: "<?",
    gguf.GGUFValueType.UINT64: "<Q",
    gguf.GGUFValueType.INT64: "<q",
    gguf.GGUFValueType.FLOAT64: "<d",
}
"""Scalar value types and their ``struct`` formats."""

NUMPY_SCALARS = {kind: np.dtype(fmt) for kind, fmt in SCALARS.items() if fmt != "<?"}

PLAIN_TYPES = {
    gguf.GGMLQuantizationType.F32: np.dtype("<f4"),
    gguf.GGMLQuantizationType.F16: np.dtype("<f2"),
    gguf.GGMLQuantizationType.BF16: np.dtype("<u2"),  # bfloat16 bit patterns
}
"""Element types held one value per element; the rest are blocks (``GGML_QUANT_SIZES``)."""


def is_gguf(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a file that starts as a GGUF file does (it may still be broken)."""
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except (OSError, ValueError):  # a directory, a missing file, a NUL byte in the path
        return False


class GGUFFile:
    """One GGUF file: its checked metadata and tensor infos over memory-mapped data.

    ``metadata`` maps each key to a Python value: ``int``, ``float``, ``bool``, ``str``, or a
    list of them (nested lists for arrays of arrays). ``tensors`` maps each tensor's name to
    ``(ggml type, NumPy shape, begin, end)``, the shape slowest dimension first and
    ``begin``/``end`` its byte range in the file.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                self._data = (
                    np.memmap(f, dtype=np.uint8, mode="r") if size else np.empty(0, np.uint8)
                )
        except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
            raise CheckpointError(f"{self.path}: cannot read ({exc})") from None
        self._size = size
        self._offset = 0
        self._where = "the header"
        self.metadata: dict[str, object] = {}
        self.tensors: dict[str, tuple[gguf.GGMLQuantizationType, tuple[int, ...], int, int]] = {}
        self._parse()

    # -- errors -------------------------------------------------------------------------------
    def _error(self, message: str, where: str | None = None) -> CheckpointError:
        return CheckpointError(f"{self.path}, {where or self._where}: {message}")

    # -- reading primitives, each checked against the bytes left --------------------------------
    def _take(self, n: int) -> memoryview:
        if n > self._size - self._offset:
            raise self._error(
                f"truncated: needs {n} bytes at offset {self._offset} of a {self._size}-byte file"
            )
        view = memoryview(self._data)[self._offset : self._offset + n]
        self._offset += n
        return view

    def _scalar(self, fmt: str) -> int | float | bool:
        (value,) = struct.unpack(fmt, self._take(struct.calcsize(fmt)))
        return value

    def _count(self, what: str, smallest_item: int) -> int:
        """A uint64 count of items of at least ``smallest_item`` bytes each, refused when the
        rest of the file cannot hold that many: the bound that keeps every loop and
        allocation below the file's own size."""
        count = self._scalar("<Q")
        if count * smallest_item > self._size - self._offset:
            raise self._error(
                f"{what} {count} cannot fit in the {self._size - self._offset} bytes left"
            )
        return count

    def _string(self, what: str = "string") -> str:
        length = self._count(f"{what} length", 1)
        try:
            return str(self._take(length), "utf-8")
        except UnicodeDecodeError as exc:
            raise self._error(f"{what} is not UTF-8 ({exc.reason} at byte {exc.start})") from None

    def _value_type(self) -> gguf.GGUFValueType:
        raw = self._scalar("<I")
        try:
            return gguf.GGUFValueType(raw)
        except ValueError:
            raise self._error(f"unknown value type {raw}") from None

    def _value(self, kind: gguf.GGUFValueType, depth: int = 0) -> object:
        if kind == gguf.GGUFValueType.STRING:
            return self._string()
        if kind != gguf.GGUFValueType.ARRAY:
            return self._scalar(SCALARS[kind])
        if depth == MAX_ARRAY_DEPTH:
            raise self._error(f"arrays nested more than {MAX_ARRAY_DEPTH} deep")
        item = self._value_type()
        if item in NUMPY_SCALARS:  # a numeric array in one read, not one call per element
            dtype = NUMPY_SCALARS[item]
            count = self._count("array length", dtype.itemsize)
            return np.frombuffer(self._take(count * dtype.itemsize), dtype).tolist()
        # Strings take at least their 8-byte length, booleans 1 byte, arrays 12 bytes.
        smallest = {gguf.GGUFValueType.STRING: 8, gguf.GGUFValueType.ARRAY: 12}.get(item, 1)
        count = self._count("array length", smallest)
        return [self._value(item, depth + 1) for _ in range(count)]

    # -- the file -----------------------------------------------------------------------------
    def _parse(self) -> None:
        if bytes(self._data[:4]) != MAGIC:
            raise self._error(f"not a GGUF file (it does not start with {MAGIC!r})")
        self._offset = len(MAGIC)
        version = self._scalar("<I")
        if version not in VERSIONS:
            raise self._error(f"GGUF version {version} is not supported (only {VERSIONS})")
        num_tensors = self._count("tensor count", 32)  # name length, rank, a size, type, offset
        num_metadata = self._count("metadata count", 12)  # key length, value type at least
        for index in range(num_metadata):
            self._where = f"metadata entry {index}"
            key = self._string("key")
            self._where = f"key {_short(key, 200)}"
            if len(key) > MAX_KEY_BYTES:
                raise self._error(f"key of {len(key)} bytes (at most {MAX_KEY_BYTES})")
            if key in self.metadata:
                raise self._error("the key appears twice")
            self.metadata[key] = self._value(self._value_type())
        self._where = "key 'general.alignment'"
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not (
            type(alignment) is int and 1 <= alignment <= 2**20 and not alignment & (alignment - 1)
        ):
            raise self._error(f"{_short(alignment)} is not a power of two up to 2**20")
        infos: list[tuple[str, gguf.GGMLQuantizationType, list[int], int]] = []
        for index in range(num_tensors):
            infos.append(self._tensor_info(index, {info[0] for info in infos}))
        data_start = -(-self._offset // alignment) * alignment
        self._check_ranges(infos, data_start, alignment)

    def _tensor_info(
        self, index: int, seen: set[str]
    ) -> tuple[str, gguf.GGMLQuantizationType, list[int], int]:
        self._where = f"tensor info {index}"
        name = self._string("tensor name")
        self._where = f"tensor {_short(name, 200)}"
        if len(name) > MAX_KEY_BYTES:
            raise self._error(f"name of {len(name)} bytes (at most {MAX_KEY_BYTES})")
        if name in seen:
            raise self._error("the name appears twice")
        num_dims = self._scalar("<I")
        if not 1 <= num_dims <= MAX_DIMS:
            raise self._error(f"{num_dims} dimensions (ggml tensors have 1 to {MAX_DIMS})")
        dims = [self._scalar("<Q") for _ in range(num_dims)]
        raw_type = self._scalar("<I")
        try:
            kind = gguf.GGMLQuantizationType(raw_type)
        except ValueError:
            raise self._error(f"unknown ggml type {raw_type}") from None
        offset = self._scalar("<Q")
        if not all(1 <= d for d in dims) or math.prod(dims) > MAX_BYTES:
            raise self._error(f"dimensions {dims} are not positive sizes of an array")
        block, _ = gguf.GGML_QUANT_SIZES[kind]
        if dims[0] % block:
            raise self._error(
                f"a row of {dims[0]} {kind.name} values is not whole blocks of {block}"
            )
        return name, kind, dims, offset

    def _check_ranges(self, infos: list, data_start: int, alignment: int) -> None:
        """Each tensor's bytes: aligned, inside the file, overlapping no other tensor's."""
        spans = []
        for name, kind, dims, offset in infos:
            where = f"tensor {_short(name, 200)}"
            block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
            nbytes = math.prod(dims[1:]) * (dims[0] // block) * block_bytes
            begin = data_start + offset
            if offset % alignment:
                raise self._error(f"offset {offset} is not a multiple of {alignment}", where)
            if nbytes > self._size - begin:
                raise self._error(
                    f"its {nbytes} bytes at offset {offset} of the data section run past the "
                    f"end of the file ({self._size} bytes, data from {data_start})",
                    where,
                )
            shape = tuple(reversed(dims))
            self.tensors[name] = (kind, shape, begin, begin + nbytes)
            spans.append((begin, begin + nbytes, name))
        spans.sort()
        for (_, end, previous), (begin, _, name) in zip(spans, spans[1:], strict=False):
            if begin < end:
                raise self._error(
                    f"its bytes overlap those of tensor {_short(previous, 200)}",
                    f"tensor {_short(name, 200)}",
                )

    # -- access -------------------------------------------------------------------------------
    def raw(self, name: str) -> np.ndarray:
        """Tensor ``name``'s stored values, read-only: F32, F16 and BF16 (as uint16 bit
        patterns) in their NumPy shape; every other type as ``uint8`` of shape ``(rows, bytes
        per row)`` (for block types, a row is whole blocks)."""
        kind, shape, begin, end = self.tensors[name]
        data = self._data[begin:end]
        if kind in PLAIN_TYPES:
            return data.view(PLAIN_TYPES[kind]).reshape(shape)
        block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
        return data.reshape(math.prod(shape[:-1]), shape[-1] // block * block_bytes)
