"""Fuzzing the checkpoint loader with mutations of real safetensors files.

The files are real: tiny ones written by the ``safetensors`` package (and torch for
bfloat16), and stories260K's own ``model.safetensors``. Each example damages one in one way
-- flipped bytes, truncation in every region, an edited header field (dtype, shape,
data_offsets: values, types, huge or negative numbers, non-finite literals), a repeated key,
overlapping or out-of-bounds ranges, a wrong header length -- and loads every tensor. The
property: loading either succeeds with exactly the tensors the header
describes (the unmutated ones bit for bit as written) or raises ``CheckpointError`` naming
the file; never any other exception. When the reference reader (the ``safetensors`` package)
accepts a mutated file, mie must accept it too and read the same values.
"""

import json
import math
import re
import shutil
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
from conftest import require_module
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from mie.checkpoint import ITEM_SIZES, MAX_RANK, Checkpoint, CheckpointError, SafetensorsFile
from mie.model import Model

torch = require_module("torch")
safetensors_numpy = require_module("safetensors.numpy")
load_file, save_file = safetensors_numpy.load_file, safetensors_numpy.save_file
save_torch_file = require_module("safetensors.torch").save_file

STORIES = Path(__file__).resolve().parents[1] / "models" / "stories260K"

NUMPY_DTYPES = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "I64": "<i8", "U8": "u1"}


def split(content: bytes) -> tuple[dict, bytes, bytes]:
    """A safetensors file's parsed header, its header bytes and its data section."""
    (length,) = struct.unpack("<Q", content[:8])
    header_bytes = content[8 : 8 + length]
    return json.loads(header_bytes), header_bytes, content[8 + length :]


def tiny_files() -> dict[str, bytes]:
    """Small real files from the reference writers: every dtype mie converts, others it
    refuses to convert, a scalar, an empty tensor, metadata."""
    rng = np.random.default_rng(11)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "a.safetensors"
        save_file(
            {
                "w": rng.standard_normal((3, 4)).astype(np.float32),
                "h": rng.standard_normal(5).astype(np.float16),
                "scalar": np.array(1.5, dtype=np.float32),
                "empty": np.zeros((0, 3), dtype=np.float32),
                "steps": np.arange(2, dtype=np.int64),
            },
            path,
            metadata={"format": "np"},
        )
        out["numpy"] = path.read_bytes()
        generator = torch.Generator().manual_seed(3)
        save_torch_file(
            {
                "model.norm.weight": torch.randn(6, generator=generator).to(torch.bfloat16),
                "lm_head.weight": torch.randn(2, 6, generator=generator),
            },
            str(path),
            metadata={"format": "pt"},
        )
        out["torch"] = path.read_bytes()
    return out


ORIGINALS = {**tiny_files(), "stories260K": (STORIES / "model.safetensors").read_bytes()}


def reference_values(header: dict, data: bytes) -> dict[str, np.ndarray]:
    """An independent reading of a header's float tensors as float32 (the test's oracle)."""
    values = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        raw = data[begin:end]
        if entry["dtype"] == "BF16":
            bits = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
            values[name] = bits.view(np.float32).reshape(entry["shape"])
        elif entry["dtype"] in ("F32", "F16"):
            array = np.frombuffer(raw, dtype=NUMPY_DTYPES[entry["dtype"]])
            values[name] = array.astype(np.float32).reshape(entry["shape"])
    return values


ORIGINAL_VALUES = {
    key: reference_values(*split(content)[::2]) for key, content in ORIGINALS.items()
}


# -- mutations ---------------------------------------------------------------------------------

RAW = "\x00raw{}\x00"
"""A placeholder string: ``json.dumps`` writes it, then it is replaced by raw JSON text, so a
header can carry what ``json.dumps`` would never write (``1e999``, a 5,000-digit integer)."""

RAW_NUMBERS = [
    "1e999",
    "-1e999",
    "NaN",
    "Infinity",
    "-Infinity",
    "1" + "0" * 5000,
    "-0",
    "1.0",
    "0.0",
    "16.000000000000001",
    "1e2",
    "18446744073709551616",
    "9223372036854775808",
    "-1",
]
"""Number spellings that parse to something other than a plain small int, or not at all."""

huge_ints = st.sampled_from(
    [2**31, 2**32, 2**63 - 1, 2**63, 2**64, 2**64 + 16, 10**30, -(10**30), -(2**63)]
)
numbers = (
    st.integers(-4, 64)
    | huge_ints
    | st.integers(-(2**80), 2**80)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.booleans()
)
junk = st.recursive(
    st.none() | numbers | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=5,
)
dtypes = st.sampled_from(sorted(ITEM_SIZES)) | st.sampled_from(["f32", "F33", "", "FLOAT"])
shapes = st.lists(numbers, max_size=4) | junk | st.lists(st.integers(0, 5), min_size=33)
offsets = st.lists(numbers, min_size=0, max_size=3) | junk


@st.composite
def mutated(draw, name: str):
    """``(content, kind)``: the real file ``name`` damaged one way."""
    original = ORIGINALS[name]
    header, header_bytes, data = split(original)
    names = [n for n in header if n != "__metadata__"]
    kinds = [
        "field",
        "raw number",
        "entry",
        "duplicate",
        "overlap",
        "flip",
        "truncate",
        "length",
        "empty",
        "metadata",
    ]
    kind = draw(st.sampled_from(kinds))
    raws: list[str] = []
    data = bytearray(data)
    if kind == "field":
        entry = header[draw(st.sampled_from(names))]
        key = draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
        strategy = {"dtype": dtypes | junk, "shape": shapes, "data_offsets": offsets}[key]
        if draw(st.booleans()):
            entry[key] = draw(strategy)
        elif key != "dtype" and isinstance(entry[key], list) and entry[key]:
            index = draw(st.integers(0, len(entry[key]) - 1))  # one element of the list
            entry[key][index] = draw(numbers)
        else:
            del entry[key]
    elif kind == "raw number":
        entry = header[draw(st.sampled_from(names))]
        key = draw(st.sampled_from(["shape", "data_offsets", "an ignored field"]))
        if key == "an ignored field":  # NaN is not JSON even where nobody reads it
            raws.append(draw(st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999"])))
            entry[key] = RAW.format(0)
        else:
            raws.append(draw(st.sampled_from(RAW_NUMBERS)))
            if entry[key]:
                entry[key][draw(st.integers(0, len(entry[key]) - 1))] = RAW.format(0)
            else:
                entry[key] = [RAW.format(0)]
    elif kind == "entry":
        action = draw(st.sampled_from(["junk", "delete", "rename", "add"]))
        target = draw(st.sampled_from(names))
        if action == "junk":
            header[target] = draw(junk)
        elif action == "delete":
            del header[target]
        elif action == "rename":
            header[draw(st.text(max_size=8))] = header.pop(target)
        elif action == "add":
            header[draw(st.text(max_size=8))] = {
                "dtype": draw(dtypes),
                "shape": draw(st.lists(st.integers(0, 4), max_size=2)),
                "data_offsets": draw(
                    st.lists(st.integers(0, len(data) + 8), min_size=2, max_size=2)
                ),
            }
    elif kind == "metadata":
        header["__metadata__"] = draw(
            junk | st.dictionaries(st.text(max_size=4), st.text(max_size=4) | junk, max_size=3)
        )
    elif kind == "duplicate":
        # A key written twice, in the header or inside an entry: json keeps the last silently.
        target = draw(st.sampled_from(names))
        opening = f"{json.dumps(target)}: {{"
        if draw(st.booleans()):  # the tensor twice
            again = f"{json.dumps(target)}: {json.dumps(header[target])}, {opening}"
        else:  # a field twice inside its entry
            again = f'{opening}"{draw(st.sampled_from(sorted(header[target])))}": 0, '
        header_bytes = json.dumps(header).replace(opening, again, 1).encode()
    elif kind == "empty":
        # No bytes, so the byte-count check passes whatever the other sizes are: NumPy still
        # cannot describe a shape whose non-zero sizes multiply past its limit, or 65 dims.
        entry = header[draw(st.sampled_from(names))]
        rank = draw(st.sampled_from([0, 3, MAX_RANK - 1, MAX_RANK, 64, 70]))
        sizes = draw(st.lists(st.sampled_from([1, 2, 3]), min_size=rank, max_size=rank + 2))
        for _ in range(draw(st.integers(0, 2))):
            sizes.insert(draw(st.integers(0, len(sizes))), draw(huge_ints.filter(lambda n: n > 0)))
        sizes.insert(draw(st.integers(0, len(sizes))), 0)
        begin = draw(st.integers(0, len(data)))
        entry.update(shape=sizes, data_offsets=[begin, begin])
    elif kind == "overlap":
        # Move one tensor's range onto another's, or past the end of the data section.
        entry = header[draw(st.sampled_from(names))]
        begin, end = entry["data_offsets"]
        shift = draw(st.integers(-len(data) - 4, len(data) + 4))
        entry["data_offsets"] = [begin + shift, end + shift]
    if kind not in ("duplicate", "flip", "truncate", "length"):
        text = json.dumps(header)
        header_bytes = text.encode()
    if kind not in ("flip", "truncate", "length"):
        text = header_bytes.decode()
        for i, raw in enumerate(raws):
            text = text.replace(json.dumps(RAW.format(i)), raw)
        header_bytes = text.encode()
        # Keep the writer's padding habit sometimes: trailing spaces are valid JSON.
        header_bytes += b" " * draw(st.integers(0, 8))
    content = bytearray(struct.pack("<Q", len(header_bytes)) + header_bytes + data)
    if kind == "flip":
        region = draw(st.sampled_from(["length", "header", "data", "anywhere"]))
        low, high = {
            "length": (0, 7),
            "header": (8, 7 + len(header_bytes)),
            "data": (8 + len(header_bytes), len(content) - 1),
            "anywhere": (0, len(content) - 1),
        }[region]
        for _ in range(draw(st.integers(1, 4))):
            content[draw(st.integers(low, high))] ^= 1 << draw(st.integers(0, 7))
    elif kind == "truncate":
        region = draw(st.sampled_from(["length", "header", "header end", "data"]))
        cut = {
            "length": st.integers(0, 7),
            "header": st.integers(8, 7 + len(header_bytes)),
            "header end": st.just(8 + len(header_bytes)),
            "data": st.integers(8 + len(header_bytes), len(content) - 1),
        }[region]
        content = content[: draw(cut)]
    elif kind == "length":
        true_length = len(header_bytes)
        content[:8] = struct.pack(
            "<Q",
            draw(
                st.integers(max(true_length - 16, 0), true_length + 16)
                | st.integers(0, 2**64 - 1)
                | st.sampled_from([0, 2**63, 2**64 - 1, len(content)])
            ),
        )
    return bytes(content), kind


def spec_verdict(content: bytes) -> str | None:
    """Why the loader's documented rules refuse ``content``, or None if they accept it.

    Written from the rules in docs/compute.md, not from mie's code: the header length fits
    the file; the header is a JSON object without repeated keys or ``NaN``/``Infinity``;
    ``__metadata__`` is null or an object of strings; each entry has a known dtype, a shape
    of at most ``MAX_RANK`` non-negative ints that NumPy can describe, ``data_offsets``
    ``[begin, end]`` inside the data section matching ``shape x itemsize``; no two ranges
    overlap.
    """
    if len(content) < 8:
        return "truncated"
    (length,) = struct.unpack("<Q", content[:8])
    if length > len(content) - 8:
        return "header length"

    def no_repeats(pairs):
        keys = [key for key, _ in pairs]
        if len(set(keys)) != len(keys):
            raise ValueError("repeated key")
        return dict(pairs)

    def no_constants(name):
        raise ValueError(name)

    try:
        header = json.loads(
            content[8 : 8 + length].decode("utf-8"),
            object_pairs_hook=no_repeats,
            parse_constant=no_constants,
        )
    except (ValueError, RecursionError):
        return "JSON"
    if not isinstance(header, dict):
        return "not an object"
    data_size = len(content) - 8 - length
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        return "metadata"

    def count(value):
        return type(value) is int and value >= 0

    ranges = []
    for entry in header.values():
        if not isinstance(entry, dict) or str(entry.get("dtype")) not in ITEM_SIZES:
            return "entry or dtype"
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if not (isinstance(shape, list) and len(shape) <= MAX_RANK and all(map(count, shape))):
            return "shape"
        item = ITEM_SIZES[entry["dtype"]]
        if math.prod(d for d in shape if d) * item >= 2**63:
            return "shape too large"
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(count, offsets))):
            return "offsets"
        begin, end = offsets
        if not begin <= end <= data_size or end - begin != math.prod(shape) * item:
            return "offsets"
        if begin < end:
            ranges.append((begin, end))
    ranges.sort()
    if any(b < prev_end for (_, prev_end), (b, _) in zip(ranges, ranges[1:], strict=False)):
        return "overlap"
    return None


def check(path: Path, content: bytes, original: str) -> str:
    """The property, for one mutated file written at ``path``; returns the outcome."""
    path.write_bytes(content)
    try:
        file = SafetensorsFile(path)
        loaded = {}
        for name in file.names:
            try:
                loaded[name] = file.tensor(name)
            except CheckpointError as exc:  # only a dtype mie does not convert
                assert re.search(r"dtype \w+ cannot be converted", str(exc)), exc
                assert str(path) in str(exc) and repr(name)[:100] in str(exc)
    except CheckpointError as exc:
        assert str(path) in str(exc), exc
        assert spec_verdict(content) is not None, f"refused a file the rules accept: {exc}"
        _reference_must_refuse_too(path, exc)
        return "CheckpointError"
    assert spec_verdict(content) is None, (
        f"accepted a file the rules refuse: {spec_verdict(content)}"
    )
    header, _, data = split(content)
    expected = reference_values(header, data)
    assert set(loaded) == set(expected)
    for name, values in loaded.items():
        assert values.dtype == np.float32 and values.shape == file.shape(name)
        np.testing.assert_array_equal(values, expected[name])
        # An entry and bytes left as they were: the very values the writer wrote.
        original_header, _, original_data = split(ORIGINALS[original])
        begin, end = header[name]["data_offsets"]
        if (
            header[name] == original_header.get(name)
            and data[begin:end] == original_data[begin:end]
        ):
            assert values.tobytes() == ORIGINAL_VALUES[original][name].tobytes(), name
    return "loaded"


def _reference_must_refuse_too(path: Path, exc: CheckpointError) -> None:
    """What the reference reader accepts, mie reads too (a repeated key aside: the reference
    keeps the last silently, mie refuses)."""
    if "repeats the key" in str(exc) or f"at most {MAX_RANK}" in str(exc):
        return  # mie's own documented limits
    try:
        load_file(path)
    except Exception:  # SafetensorError, or the numpy front end's dtype and shape limits
        return
    pytest.fail(f"the safetensors package reads {path}, mie refused it: {exc}")


def fuzz_settings(max_examples: int) -> settings:
    return settings(
        max_examples=max_examples,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


@fuzz_settings(500)
@given(data=st.data())
def test_mutated_tiny_files_load_exactly_or_raise_checkpoint_error(tmp_path, data):
    original = data.draw(st.sampled_from(["numpy", "torch"]))
    content, kind = data.draw(mutated(original))
    event(f"{kind}: {check(tmp_path / 'fuzz.safetensors', content, original)}")


@fuzz_settings(150)
@given(data=st.data())
def test_mutated_stories260k_loads_exactly_or_raises_checkpoint_error(tmp_path, data):
    """Also through ``Model.from_pretrained``, whose shape checks see every loaded tensor."""
    content, kind = data.draw(mutated("stories260K"))
    path = tmp_path / "model.safetensors"
    outcome = check(path, content, "stories260K")
    event(f"{kind}: {outcome}")
    shutil.copyfile(STORIES / "config.json", tmp_path / "config.json")
    try:
        model = Model.from_pretrained(tmp_path)
    except CheckpointError as exc:
        assert str(path) in str(exc), exc
        return
    assert outcome == "loaded"
    assert np.isfinite(model.weights.embed.weight).all()


@pytest.mark.parametrize("original", sorted(ORIGINALS))
def test_unmutated_files_load_as_written(tmp_path, original):
    """The fuzz tests' baseline: the real files load, with the values their writers wrote."""
    assert check(tmp_path / "x.safetensors", ORIGINALS[original], original) == "loaded"
    assert ORIGINAL_VALUES[original]


# -- the shard index ---------------------------------------------------------------------------


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    weight_map=junk
    | st.dictionaries(
        st.text(max_size=6),
        junk
        | st.sampled_from(
            ["a.safetensors", "../a.safetensors", ".", "", "a\x00b", "/etc/passwd", "b.safetensors"]
        ),
        max_size=4,
    ),
    extra=st.sampled_from(["", "dup", "raw"]),
)
def test_any_index_gives_a_checkpoint_or_checkpoint_error_naming_a_file(
    tmp_path, weight_map, extra
):
    """``model.safetensors.index.json`` with any ``weight_map``: a working checkpoint over
    existing shards, or a CheckpointError naming the index or the shard."""
    save_file({"x": np.ones(2, dtype=np.float32)}, tmp_path / "a.safetensors")
    text = json.dumps({"metadata": {}, "weight_map": weight_map})
    if extra == "dup":
        text = text[:-1] + ', "weight_map": {}}'
    elif extra == "raw":
        text = text[:-1] + ', "total_size": 1' + "0" * 5000 + "}"
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(text)
    try:
        checkpoint = Checkpoint(tmp_path)
        for name in checkpoint:
            checkpoint.tensor(name)
    except CheckpointError as exc:
        assert str(index) in str(exc) or str(tmp_path) in str(exc), exc
        return
    assert set(checkpoint) == set(weight_map) and all(
        v == "a.safetensors" for v in weight_map.values()
    )
