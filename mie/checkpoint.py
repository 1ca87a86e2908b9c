"""Read Hugging Face checkpoints: safetensors files, their shard index, and JSON configs.

A safetensors file is an 8-byte little-endian header length ``N``, then ``N`` bytes of JSON
naming each tensor's dtype, shape and ``[begin, end)`` byte range in the data section that
follows. mie parses that itself (no torch, no safetensors package at run time) and treats
every header field as hostile until checked: the header length against the file size, each
byte range against the data section and the other ranges, each ``shape x dtype`` against its
byte range. Only then is anything allocated, so a corrupt file costs at most one error.

The data section is memory-mapped; ``tensor`` converts one tensor at a time to float32 and
``stored_tensor`` copies one out in the dtype the file stores (float32, float16, bfloat16), so
loading a model never holds a second copy of the whole checkpoint. ``tensor(...,
require_finite=True)`` also refuses a tensor holding NaN or infinity: such a weight makes
every output NaN (or silently wrong), and it is far cheaper to find at load than at step 1.

Every problem raises ``CheckpointError``, whose message names the file and, where there is
one, the tensor -- never a bare ``ValueError`` or ``OverflowError`` from ``json`` or NumPy,
whatever the bytes are: the tests fuzz real files (byte flips, truncation, edited fields,
huge numbers) to hold that.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator

import ml_dtypes
import numpy as np

from mie.checks import is_int
from mie.checks import short_repr as _short

MAX_HEADER_BYTES = 100 * 1024 * 1024
"""Largest JSON header accepted (the safetensors format's own limit)."""

MAX_RANK = 32
"""Most dimensions a tensor may have: NumPy 1.x's limit (2.x allows 64); weights have 1 or 2."""

MAX_BYTES = int(np.iinfo(np.intp).max)
"""Largest array NumPy can describe: a shape whose non-zero sizes multiply past it cannot be
reshaped to even when another size is 0 (and so the tensor holds no bytes)."""

ITEM_SIZES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "F64": 8,
}
"""Bytes per element of every dtype the format defines; only F32, F16 and BF16 convert."""

STORED_DTYPES = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}
"""The dtypes mie loads, as NumPy holds them (little-endian, as the format requires)."""

SINGLE_FILE = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint file is missing, truncated, malformed or lacks a tensor."""


class SafetensorsFile:
    """One ``.safetensors`` file: a validated header over a memory-mapped data section."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        try:
            file_size = os.path.getsize(self.path)
            with open(self.path, "rb") as f:
                prefix = f.read(8)
                header_len = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
                if not 0 <= header_len <= min(file_size - 8, MAX_HEADER_BYTES):
                    raise self._error(
                        f"header length {header_len} does not fit a file of {file_size} bytes"
                        if header_len >= 0
                        else f"truncated: {file_size} bytes, too short for the header length"
                    )
                header_bytes = f.read(header_len)
        except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
            raise CheckpointError(f"{self.path}: cannot read ({exc})") from None
        self._data_offset = 8 + header_len
        self._data_size = file_size - self._data_offset
        self._entries = self._parse_header(header_bytes)
        try:
            self._data = (
                np.memmap(self.path, dtype=np.uint8, mode="r", offset=self._data_offset)
                if self._data_size
                else np.empty(0, dtype=np.uint8)
            )
        except (OSError, ValueError) as exc:  # e.g. the file shrank since it was measured
            raise self._error(f"cannot map the data section ({exc})") from None

    # -- header validation ----------------------------------------------------------------
    def _error(self, message: str, name: str | None = None) -> CheckpointError:
        where = f"{self.path}, tensor {_short(name, 200)}" if name is not None else self.path
        return CheckpointError(f"{where}: {message}")

    def _parse_header(
        self, header_bytes: bytes
    ) -> dict[str, tuple[str, tuple[int, ...], int, int]]:
        """``name -> (dtype, shape, begin, end)`` after checking every field."""
        try:
            header = json.loads(
                header_bytes.decode("utf-8"),
                object_pairs_hook=_unique_keys,
                parse_constant=_no_constant,
            )
        except _DuplicateKey as exc:
            raise self._error(f"header repeats the key {_short(exc.args[0], 200)}") from None
        except (ValueError, RecursionError) as exc:
            # ValueError covers JSONDecodeError, UnicodeDecodeError and the integer-digits
            # limit (an integer of thousands of digits is not a JSONDecodeError).
            raise self._error(f"header is not valid JSON ({exc})") from None
        if not isinstance(header, dict):
            raise self._error("header is not a JSON object")
        metadata = header.pop("__metadata__", None)
        metadata = {} if metadata is None else metadata  # null, as the format allows
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise self._error("__metadata__ is not an object of strings")
        entries = {name: self._parse_entry(name, info) for name, info in header.items()}
        ranges = sorted(
            (begin, end, name) for name, (_, _, begin, end) in entries.items() if begin < end
        )
        for (_, prev_end, prev), (begin, _, name) in zip(ranges, ranges[1:], strict=False):
            if begin < prev_end:
                raise self._error(f"bytes overlap those of tensor {_short(prev, 200)}", name)
        return entries

    def _parse_entry(self, name: str, info: object) -> tuple[str, tuple[int, ...], int, int]:
        if not isinstance(info, dict):
            raise self._error("header entry is not an object", name)
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in ITEM_SIZES:
            raise self._error(f"unknown dtype {_short(dtype)}", name)
        if (
            not isinstance(shape, list)
            or len(shape) > MAX_RANK
            or not all(_is_count(d) for d in shape)
        ):
            raise self._error(
                f"shape {_short(shape)} is not a list of at most {MAX_RANK} non-negative ints",
                name,
            )
        if math.prod(d for d in shape if d) * ITEM_SIZES[dtype] > MAX_BYTES:
            raise self._error(f"shape {_short(shape)} is too large for an array", name)
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(_is_count(o) for o in offsets)
            or not offsets[0] <= offsets[1] <= self._data_size
        ):
            raise self._error(
                f"data_offsets {_short(offsets)} are not [begin, end] inside the "
                f"{self._data_size}-byte data section",
                name,
            )
        begin, end = offsets
        expected = ITEM_SIZES[dtype] * math.prod(shape)
        if expected != end - begin:
            raise self._error(
                f"shape {shape} of {dtype} needs {expected} bytes, data_offsets give {end - begin}",
                name,
            )
        return dtype, tuple(shape), begin, end

    # -- access -----------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name)[1]

    def _entry(self, name: str) -> tuple[str, tuple[int, ...], int, int]:
        if name not in self._entries:
            raise self._error("no such tensor", name)
        return self._entries[name]

    def tensor(self, name: str, require_finite: bool = False) -> np.ndarray:
        """Tensor ``name`` as a new float32 array (F32, F16 and BF16 convert exactly).

        With ``require_finite``, a tensor holding NaN or infinity raises ``CheckpointError``.
        """
        return self.stored_tensor(name, require_finite).astype(np.float32, copy=False)

    def stored_tensor(self, name: str, require_finite: bool = False) -> np.ndarray:
        """Tensor ``name`` as a new array in the dtype the file stores it in: float32,
        float16 or ``ml_dtypes.bfloat16`` (so a 16-bit checkpoint loads into 16 bits without
        passing through float32). ``require_finite`` as for ``tensor``."""
        dtype, shape, begin, end = self._entry(name)
        if dtype not in STORED_DTYPES:
            raise self._error(f"dtype {dtype} cannot be converted to float32", name)
        values = np.array(self._data[begin:end]).view(STORED_DTYPES[dtype])
        if require_finite and not all_finite(values):
            bad = np.flatnonzero(~np.isfinite(values))
            raise self._error(
                f"{bad.size} of {values.size} values are NaN or infinite (the first is "
                f"{values[bad[0]]} at flat index {bad[0]}); pass allow_non_finite_weights=True "
                "to load them anyway",
                name,
            )
        return values.reshape(shape)


def _is_count(value: object) -> bool:
    """A JSON non-negative integer (``True`` is not a count)."""
    return is_int(value) and value >= 0


def all_finite(values: np.ndarray) -> bool:
    """No NaN and no infinity in ``values``, at about the cost of one read.

    The sum is finite only if every value is (NaN and inf propagate, inf - inf is NaN), and a
    pairwise float32 sum reads the array once without the boolean temporary ``isfinite``
    makes. A non-finite sum may still be a finite overflow of large values, so only then is
    every value looked at.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        if np.isfinite(values.sum(dtype=np.float32)):
            return True
    return bool(np.isfinite(values).all())


class _DuplicateKey(Exception):
    """A JSON object repeats a key (``json`` would silently keep the last)."""


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    result = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKey(key)
        result[key] = value
    return result


def _no_constant(name: str) -> float:
    """Refuse ``NaN``/``Infinity``, which Python's ``json`` accepts but JSON does not."""
    raise ValueError(f"{name} is not JSON")


class Checkpoint:
    """The tensors of a checkpoint directory: one ``model.safetensors``, or shards + index."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = os.fspath(directory)
        single = os.path.join(self.directory, SINGLE_FILE)
        index = os.path.join(self.directory, SHARD_INDEX)
        if listed(single):
            file = SafetensorsFile(single)
            self._source = single  # the file that lists the tensors, for messages
            self._files = {SINGLE_FILE: file}
            self._where = dict.fromkeys(file.names, SINGLE_FILE)
        elif listed(index):
            self._source = index
            self._where = _read_weight_map(index)
            self._files = {
                shard: SafetensorsFile(os.path.join(self.directory, shard))
                for shard in sorted(set(self._where.values()))
            }
        else:
            raise CheckpointError(f"{self.directory}: neither {SINGLE_FILE} nor {SHARD_INDEX}")

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def _file(self, name: str) -> SafetensorsFile:
        if name not in self._where:
            raise CheckpointError(f"{self._source}: no tensor {_short(name, 200)}")
        return self._files[self._where[name]]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._file(name).shape(name)

    def tensor(
        self, name: str, shape: tuple[int, ...] | None = None, require_finite: bool = False
    ) -> np.ndarray:
        """Tensor ``name`` as float32; with ``shape``, also check it has that shape; with
        ``require_finite``, that it holds no NaN or infinity."""
        return self.stored_tensor(name, shape, require_finite).astype(np.float32, copy=False)

    def stored_tensor(
        self, name: str, shape: tuple[int, ...] | None = None, require_finite: bool = False
    ) -> np.ndarray:
        """As ``tensor``, but in the dtype the file stores (``SafetensorsFile.stored_tensor``)."""
        file = self._file(name)
        if shape is not None and file.shape(name) != tuple(shape):
            raise file._error(
                f"shape {list(file.shape(name))}, the config needs {list(shape)}", name
            )
        return file.stored_tensor(name, require_finite=require_finite)


def _read_weight_map(index_path: str) -> dict[str, str]:
    """The index's ``tensor name -> shard file name``, with shards confined to the directory."""
    weight_map = read_json(index_path).get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index_path}: no 'weight_map' object")
    for name, shard in weight_map.items():
        if (
            not isinstance(shard, str)
            or os.path.basename(shard) != shard
            or shard in ("", ".", "..")
            or "\0" in shard
        ):
            raise CheckpointError(
                f"{index_path}, tensor {_short(name, 200)}: bad shard file name {_short(shard)}"
            )
    return weight_map


def listed(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is in its directory at all, readable or not.

    An optional file (``tokenizer.json``, ``tokenizer_config.json``,
    ``generation_config.json``) is absent only when this is False. ``os.path.exists`` is also
    False for a symlink whose target is missing or that loops -- a Hugging Face cache whose
    blob is gone -- which would silently change the EOS tokens or drop the tokenizer; such a
    file is listed, so its reader runs and fails naming it.
    """
    return os.path.lexists(path)


def read_json(path: str | os.PathLike[str]) -> dict:
    """A JSON object from ``path`` (``config.json`` and friends); a repeated key is an error.

    ``NaN`` and ``Infinity`` parse (Python's ``json`` accepts them, and transformers writes
    them): whoever reads a number checks it is finite, and names the field if not.
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            content = f.read()
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        raise CheckpointError(f"{path}: cannot read ({exc})") from None
    try:
        value = json.loads(content.decode("utf-8"), object_pairs_hook=_unique_keys)
    except _DuplicateKey as exc:
        raise CheckpointError(f"{path}: repeats the key {_short(exc.args[0], 200)}") from None
    except (ValueError, RecursionError) as exc:  # also bad UTF-8, the integer-digits limit
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: not a JSON object")
    return value


def read_config(directory: str | os.PathLike[str]) -> dict:
    """The checkpoint's ``config.json`` as a dict."""
    return read_json(os.path.join(directory, "config.json"))
