"""The GGUF reader against llama.cpp's own Python reader and writer, and under fuzzing.

* Files written by ``gguf.GGUFWriter`` (metadata of every value type, tensors of plain and
  block types, drawn by hypothesis) read back as ``gguf.GGUFReader`` reads them: the same
  metadata, the same tensor types, shapes and bytes.
* Every way a file can lie is a ``CheckpointError`` naming the file and the key or tensor:
  truncation, a wrong magic or version, counts the file cannot hold (an array of 10⁹
  elements), unknown value and tensor types, duplicate keys and names, absurd dimensions,
  rows that are not whole blocks, misaligned or overlapping or out-of-file tensor data.
* Fuzzing (the safetensors reader's standard, tests/test_loader_fuzz.py): thousands of
  mutated real files -- byte flips, truncations, counts and sizes overwritten with huge
  numbers -- either read (and then agree with ``gguf.GGUFReader`` where it reads them too)
  or raise ``CheckpointError``; never another exception, and never work or memory beyond
  the file's own size. ``MIE_GGUF_FUZZ=N`` runs N mutations (tens of thousands locally).
"""

from __future__ import annotations

import os
import random
import struct
import time
import tracemalloc
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mie.checkpoint import CheckpointError
from mie.gguf_file import GGUFFile, is_gguf

T = gguf.GGMLQuantizationType
V = gguf.GGUFValueType
STORIES = Path(__file__).resolve().parents[1] / "models" / "stories260K"


def write(path: Path, metadata: dict, tensors: dict[str, tuple[T, np.ndarray]]) -> Path:
    """A GGUF file by llama.cpp's writer: ``metadata`` as ``{key: (value type, value)}``,
    tensors as ``{name: (type, stored array)}``."""
    writer = gguf.GGUFWriter(path, "llama")
    for key, (kind, value) in metadata.items():
        sub = None
        if kind == V.ARRAY:
            kind, sub, value = V.ARRAY, value[0], value[1]
        writer.add_key_value(key, value, kind, sub_type=sub)
    for name, (kind, data) in tensors.items():
        if kind in (T.F32, T.F16):
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def reader_view(path: Path) -> tuple[dict, dict]:
    """What ``gguf.GGUFReader`` reads: metadata (its own ``GGUF.*`` entries left out) and
    ``{name: (type, NumPy shape, bytes)}``."""
    reader = gguf.GGUFReader(path)
    metadata = {
        name: field.contents() for name, field in reader.fields.items() if "GGUF." not in name
    }
    tensors = {
        t.name: (t.tensor_type, tuple(int(d) for d in reversed(t.shape)), t.data.tobytes())
        for t in reader.tensors
    }
    return metadata, tensors


def mie_view(path: Path) -> tuple[dict, dict]:
    file = GGUFFile(path)
    tensors = {
        name: (kind, shape, file.raw(name).tobytes())
        for name, (kind, shape, _, _) in file.tensors.items()
    }
    return file.metadata, tensors


SCALARS = {
    V.UINT8: st.integers(0, 255),
    V.INT8: st.integers(-128, 127),
    V.UINT16: st.integers(0, 2**16 - 1),
    V.INT16: st.integers(-(2**15), 2**15 - 1),
    V.UINT32: st.integers(0, 2**32 - 1),
    V.INT32: st.integers(-(2**31), 2**31 - 1),
    V.UINT64: st.integers(0, 2**64 - 1),
    V.INT64: st.integers(-(2**63), 2**63 - 1),
    V.FLOAT32: st.floats(width=32, allow_nan=False),
    V.FLOAT64: st.floats(allow_nan=False),
    V.BOOL: st.booleans(),
    V.STRING: st.text(max_size=12),
}


@st.composite
def metadata_values(draw):
    kind = draw(st.sampled_from([*SCALARS, V.ARRAY]))
    if kind != V.ARRAY:
        return kind, draw(SCALARS[kind])
    item = draw(st.sampled_from(list(SCALARS)))
    return V.ARRAY, (
        item,
        draw(st.lists(SCALARS[item], min_size=1, max_size=6)),
    )  # the writer refuses []


@st.composite
def tensors(draw):
    out = {}
    for i in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from([T.F32, T.F16, T.Q8_0, T.Q4_0, T.Q4_K, T.Q6_K]))
        block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
        rows = draw(st.integers(1, 3))
        if block == 1:
            shape = (rows, draw(st.integers(1, 5)))
            data = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
            out[f"t{i}"] = (kind, data.astype(np.float16 if kind == T.F16 else np.float32))
        else:
            blocks = draw(st.integers(1, 2))
            out[f"t{i}"] = (kind, np.full((rows, blocks * block_bytes), i, dtype=np.uint8))
    return out


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    metadata=st.dictionaries(st.text(min_size=1, max_size=10), metadata_values(), max_size=6),
    stored=tensors(),
)
def test_files_read_as_llama_cpps_reader_reads_them(tmp_path, metadata, stored):
    path = write(tmp_path / "f.gguf", metadata, stored)
    assert is_gguf(path)
    ours, theirs = mie_view(path), reader_view(path)
    assert ours[1] == theirs[1]
    assert ours[0].keys() == theirs[0].keys()
    for key, value in theirs[0].items():
        if isinstance(value, float) or (
            isinstance(value, list) and value and isinstance(value[0], float)
        ):
            np.testing.assert_array_equal(np.float64(ours[0][key]), np.float64(value), err_msg=key)
        else:
            assert ours[0][key] == value, key


def test_stories260k_written_by_the_writer_reads_as_the_reader_reads_it(tmp_path):
    from gguf_writer import write_gguf

    path = write_gguf(STORIES, tmp_path / "s.gguf", T.Q8_0)
    assert mie_view(path)[1] == reader_view(path)[1]


# -- refusals, one per lie -------------------------------------------------------------------------


def header(version=3, tensors=0, kvs=1) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, tensors, kvs)


def string(text: str | bytes) -> bytes:
    data = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(data)) + data


def kv(key: str, kind: int, payload: bytes) -> bytes:
    return string(key) + struct.pack("<I", kind) + payload


def tensor_info(name: str, dims: list[int], kind: int, offset: int) -> bytes:
    return (
        string(name)
        + struct.pack("<I", len(dims))
        + b"".join(struct.pack("<Q", d) for d in dims)
        + struct.pack("<II", kind, 0)[:4]
        + struct.pack("<Q", offset)
    )


def with_tensors(infos: list[bytes], data: bytes, alignment: int = 32) -> bytes:
    head = header(tensors=len(infos), kvs=0) + b"".join(infos)
    head += b"\0" * (-len(head) % alignment)
    return head + data


ARCH = kv("general.architecture", V.STRING, string("llama"))
CASES = {
    "empty": (b"", "not a GGUF file"),
    "magic": (b"GGUL" + header()[4:] + ARCH, "not a GGUF file"),
    "version": (header(version=7) + ARCH, "GGUF version 7 is not supported"),
    "truncated": (
        header() + ARCH[:-3],
        "key 'general.architecture': string length 5 cannot fit in the 2 bytes left",
    ),
    "tensor count": (header(tensors=10**12), "tensor count 1000000000000 cannot fit"),
    "metadata count": (header(kvs=2**63), "metadata count .* cannot fit"),
    "billion-element array": (
        header() + kv("a", V.ARRAY, struct.pack("<IQ", V.UINT32, 10**9)),
        "key 'a': array length 1000000000 cannot fit",
    ),
    "billion strings": (
        header() + kv("tokenizer.ggml.tokens", V.ARRAY, struct.pack("<IQ", V.STRING, 10**9)),
        "key 'tokenizer.ggml.tokens': array length 1000000000 cannot fit",
    ),
    "huge string": (header() + string("k") + struct.pack("<IQ", V.STRING, 2**62), "string length"),
    "value type": (header() + kv("k", 13, b""), "key 'k': unknown value type 13"),
    "duplicate key": (
        header(kvs=2) + ARCH + ARCH,
        "key 'general.architecture': the key appears twice",
    ),
    "not utf-8": (
        header() + kv("k", V.STRING, string(b"\xff\xfe")),
        "key 'k': string is not UTF-8",
    ),
    "deep arrays": (
        header() + kv("k", V.ARRAY, struct.pack("<IQ", V.ARRAY, 1) * 9 + struct.pack("<IQ", 0, 0)),
        "arrays nested more than 8 deep",
    ),
    "alignment": (
        header() + kv("general.alignment", V.UINT32, struct.pack("<I", 24)),
        "not a power of two",
    ),
    "tensor type": (
        with_tensors([tensor_info("w", [4], 99, 0)], b"\0" * 32),
        "tensor 'w': unknown ggml type 99",
    ),
    "zero dimension": (
        with_tensors([tensor_info("w", [4, 0], T.F32, 0)], b"\0" * 32),
        r"tensor 'w': dimensions \[4, 0\]",
    ),
    "absurd dimensions": (
        with_tensors([tensor_info("w", [2**40, 2**40], T.F32, 0)], b"\0" * 32),
        r"tensor 'w': dimensions .* are not positive sizes",
    ),
    "rank": (with_tensors([tensor_info("w", [1] * 5, T.F32, 0)], b""), "5 dimensions"),
    "partial block": (
        with_tensors([tensor_info("w", [48, 1], T.Q8_0, 0)], b"\0" * 64),
        "tensor 'w': a row of 48 Q8_0 values is not whole blocks of 32",
    ),
    "duplicate name": (
        with_tensors(
            [tensor_info("w", [8], T.F32, 0), tensor_info("w", [8], T.F32, 32)], b"\0" * 64
        ),
        "tensor 'w': the name appears twice",
    ),
    "misaligned": (
        with_tensors([tensor_info("w", [8], T.F32, 4)], b"\0" * 64),
        "tensor 'w': offset 4 is not a multiple of 32",
    ),
    "past the end": (
        with_tensors([tensor_info("w", [8], T.F32, 32)], b"\0" * 32),
        "tensor 'w': its 32 bytes at offset 32 of the data section run past the end",
    ),
    "lying offset": (
        with_tensors([tensor_info("w", [8], T.F32, 2**63)], b"\0" * 32),
        "tensor 'w': its 32 bytes at offset 9223372036854775808",
    ),
    "overlap": (
        with_tensors(
            [tensor_info("a", [16], T.F32, 0), tensor_info("b", [8], T.F32, 32)], b"\0" * 64
        ),
        "tensor 'b': its bytes overlap those of tensor 'a'",
    ),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_every_lie_is_a_checkpoint_error_naming_the_file_and_the_place(tmp_path, case):
    content, message = CASES[case]
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match=message) as info:
        GGUFFile(path)
    assert str(info.value).startswith(f"{path}, ")


def test_a_missing_file_and_a_directory_are_checkpoint_errors(tmp_path):
    with pytest.raises(CheckpointError, match="cannot read"):
        GGUFFile(tmp_path / "absent.gguf")
    with pytest.raises(CheckpointError, match="cannot read"):
        GGUFFile(tmp_path)
    assert not is_gguf(tmp_path) and not is_gguf(tmp_path / "absent.gguf")
    assert not is_gguf(STORIES / "model.safetensors")


def test_llama_cpps_reader_silently_reads_a_short_array_this_one_refuses(tmp_path):
    """Why mie does not parse with ``gguf.GGUFReader``: an array declaring more elements than
    the file holds comes back short from it, without an error."""
    path = tmp_path / "short.gguf"
    path.write_bytes(header() + kv("a", V.ARRAY, struct.pack("<IQ", V.UINT8, 10) + b"\1\2\3"))
    assert gguf.GGUFReader(path).fields["a"].contents() == [1, 2, 3]
    with pytest.raises(CheckpointError, match="array length 10 cannot fit in the 3 bytes left"):
        GGUFFile(path)


# -- fuzzing ---------------------------------------------------------------------------------------


def seed_files(tmp_path: Path) -> list[bytes]:
    """Small real files: stories260K in Q8_0 and F16 (tokens-free), and one of every
    metadata type with plain and block tensors."""
    from gguf_writer import write_gguf

    files = [
        write_gguf(STORIES, tmp_path / "q8.gguf", T.Q8_0).read_bytes(),
        write(
            tmp_path / "mixed.gguf",
            {
                "s": (V.STRING, "text"),
                "f": (V.FLOAT32, 1.5),
                "u": (V.UINT64, 7),
                "tokens": (V.ARRAY, (V.STRING, ["a", "bb", "ccc"])),
                "scores": (V.ARRAY, (V.FLOAT32, [0.5, -1.0, 2.0])),
            },
            {
                "a": (T.F32, np.ones((2, 3), np.float32)),
                "b": (T.Q4_0, np.zeros((2, 36), np.uint8)),
                "c": (T.F16, np.ones(5, np.float16)),
            },
        ).read_bytes(),
    ]
    return files


HUGE = [2**64 - 1, 2**63, 2**40, 10**9, 2**32 - 1, 2**31, 4097, 0]


def mutate(content: bytes, rng: random.Random) -> bytes:
    data = bytearray(content)
    how = rng.randrange(4)
    if how == 0:  # flip a few bytes, mostly in the header where the counts are
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(min(len(data), 4096) if rng.random() < 0.8 else len(data))
            data[i] ^= 1 << rng.randrange(8)
    elif how == 1:  # truncate anywhere
        del data[rng.randrange(len(data)) :]
    elif how == 2:  # a huge or zero number where a count, size, type or offset may be
        i = rng.randrange(min(len(data), 4096) - 8)
        data[i : i + 8] = struct.pack("<Q", rng.choice(HUGE))
    else:  # a 4-byte field (value type, rank, ggml type) made unknown or large
        i = rng.randrange(min(len(data), 4096) - 4)
        data[i : i + 4] = struct.pack("<I", rng.choice([13, 99, 2**31, 5, 0xFFFFFFFF]))
    return bytes(data)


def test_mutated_files_read_or_raise_checkpoint_error_within_their_own_size(tmp_path):
    count = int(os.environ.get("MIE_GGUF_FUZZ", "1500"))
    rng = random.Random(20261201)
    originals = seed_files(tmp_path)
    path = tmp_path / "m.gguf"
    outcomes = {"read": 0, "refused": 0, "reference agrees": 0}
    slowest = 0.0
    tracemalloc.start()
    try:
        for _ in range(count):
            content = mutate(rng.choice(originals), rng)
            path.write_bytes(content)
            start = time.perf_counter()
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
            try:
                ours = mie_view(path)
            except CheckpointError as exc:
                assert str(exc).startswith(str(path)), exc
                outcomes["refused"] += 1
                ours = None
            slowest = max(slowest, time.perf_counter() - start)
            peak = tracemalloc.get_traced_memory()[1] - before
            # Work and memory bounded by the file: a few times its size, never what a count says.
            assert peak < 20 * len(content) + 2**20, (peak, len(content))
            if ours is None:
                continue
            outcomes["read"] += 1
            try:
                theirs = reader_view(path)
            except Exception:  # noqa: BLE001 - the reference may refuse what mie reads
                continue
            if theirs[1] == ours[1]:
                outcomes["reference agrees"] += 1
            else:  # mie's checks are stricter: a tensor set differing means one refused it
                raise AssertionError("mie and gguf.GGUFReader read different tensors")
    finally:
        tracemalloc.stop()
    assert outcomes["read"] and outcomes["refused"], outcomes
    assert slowest < 2.0, slowest  # no hang: every file is a few hundred KB
