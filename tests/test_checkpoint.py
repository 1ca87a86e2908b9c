"""The safetensors loader against files written by the safetensors package, and hostile files.

The reference writer is the ``safetensors`` package (a transformers dependency); bfloat16
values come from torch. Broken files are built by hand, then fuzzed with hypothesis: every
outcome must be either correct tensors or a ``CheckpointError``.
"""

import json
import re
import shutil
import struct
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import require_module
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from mie.checkpoint import Checkpoint, CheckpointError, SafetensorsFile, read_config
from mie.model import Model, ModelConfig, load_weights

torch = require_module("torch")
safetensors_numpy = require_module("safetensors.numpy")
load_file, save_file = safetensors_numpy.load_file, safetensors_numpy.save_file
save_torch_file = require_module("safetensors.torch").save_file


def raw_file(path, header, data=b""):
    """A safetensors file from a header (dict or raw bytes) and data bytes, no checks."""
    header_bytes = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(header_bytes)) + header_bytes + data)
    return path


# -- reading what the reference writer wrote -------------------------------------------------------


def test_reads_f32_and_f16_as_written_by_safetensors(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {
        "a": rng.standard_normal((3, 5)).astype(np.float32),
        "b": rng.standard_normal(7).astype(np.float16),
        "scalar": np.array(2.5, dtype=np.float32),
        "empty": np.zeros((0, 4), dtype=np.float32),
    }
    save_file(tensors, tmp_path / "x.safetensors")
    file = SafetensorsFile(tmp_path / "x.safetensors")
    assert sorted(file.names) == sorted(tensors)
    for name, expected in tensors.items():
        out = file.tensor(name)
        assert out.dtype == np.float32 and out.shape == expected.shape
        np.testing.assert_array_equal(out, expected.astype(np.float32))


def test_widens_bfloat16_exactly(tmp_path):
    values = torch.randn(4, 6, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    values[0, :4] = torch.tensor([float("inf"), -0.0, 1e-40, -3.0e38])  # odd corners
    save_torch_file({"w": values}, str(tmp_path / "bf.safetensors"))
    out = SafetensorsFile(tmp_path / "bf.safetensors").tensor("w")
    np.testing.assert_array_equal(out, values.float().numpy())
    assert np.signbit(out[0, 1])


def test_sharded_checkpoint_follows_the_index(tmp_path):
    first = {"x": np.arange(6, dtype=np.float32).reshape(2, 3)}
    second = {"y": np.ones(4, dtype=np.float16)}
    save_file(first, tmp_path / "model-00001-of-00002.safetensors")
    save_file(second, tmp_path / "model-00002-of-00002.safetensors")
    index = {
        "metadata": {},
        "weight_map": {
            "x": "model-00001-of-00002.safetensors",
            "y": "model-00002-of-00002.safetensors",
        },
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    checkpoint = Checkpoint(tmp_path)
    assert sorted(checkpoint) == ["x", "y"]
    np.testing.assert_array_equal(checkpoint.tensor("x", (2, 3)), first["x"])
    np.testing.assert_array_equal(checkpoint.tensor("y"), np.ones(4))


def test_unaligned_offsets_are_read_correctly(tmp_path):
    values = np.array([1.5, -2.25, 3.0], dtype="<f4")
    header = {
        "pad": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
        "v": {"dtype": "F32", "shape": [3], "data_offsets": [1, 13]},
    }
    file = SafetensorsFile(raw_file(tmp_path / "u.safetensors", header, b"\0" + values.tobytes()))
    np.testing.assert_array_equal(file.tensor("v"), values)


# -- each kind of broken input, by hand ------------------------------------------------------

GOOD_DATA = np.arange(4, dtype="<f4").tobytes()


def good_header(**changes):
    entry = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
    entry.update(changes)
    return {"__metadata__": {"format": "pt"}, "w": entry}


MALFORMED = [
    (b"{not json", GOOD_DATA, "not valid JSON"),
    (b"\xff\xfe", GOOD_DATA, "not valid JSON"),
    (b"[1, 2]", GOOD_DATA, "not a JSON object"),
    ({"w": 3}, GOOD_DATA, "'w': header entry is not an object"),
    (good_header(dtype="F33"), GOOD_DATA, "'w': unknown dtype 'F33'"),
    (good_header(shape=[2, -2]), GOOD_DATA, "'w': shape"),
    (good_header(shape=[2, True]), GOOD_DATA, "'w': shape"),
    (good_header(shape="2x2"), GOOD_DATA, "'w': shape"),
    (good_header(data_offsets=[0, 17]), GOOD_DATA, "'w': data_offsets"),
    (good_header(data_offsets=[8, 4]), GOOD_DATA, "'w': data_offsets"),
    (good_header(data_offsets=[0]), GOOD_DATA, "'w': data_offsets"),
    (good_header(shape=[2, 3]), GOOD_DATA, "'w': shape [2, 3] of F32 needs 24 bytes"),
    (good_header(shape=[2**62, 2**62]), GOOD_DATA, "'w': shape"),
    # sizes NumPy cannot describe once another size is 0 (no bytes to check them by)
    (good_header(shape=[0, 10**30], data_offsets=[0, 0]), b"", "'w': shape [0, 1000000000000000"),
    (good_header(shape=[0, 2**62], data_offsets=[0, 0]), b"", "too large for an array"),
    (good_header(shape=[2**40, 2**40, 0], data_offsets=[0, 0]), b"", "too large for an array"),
    (good_header(shape=[0] * 65, data_offsets=[0, 0]), b"", "at most 32 non-negative ints"),
    (good_header(shape=[2, 2.0]), GOOD_DATA, "'w': shape"),
    (good_header(shape=[[2], 2]), GOOD_DATA, "'w': shape"),
    (good_header(shape=None), GOOD_DATA, "'w': shape"),
    (good_header(data_offsets=[0, 10**30]), GOOD_DATA, "'w': data_offsets"),
    (good_header(data_offsets=[-16, 0]), GOOD_DATA, "'w': data_offsets"),
    (good_header(data_offsets=[0.0, 16.0]), GOOD_DATA, "'w': data_offsets"),
    (good_header(data_offsets=[False, 16]), GOOD_DATA, "'w': data_offsets"),
    (good_header(data_offsets=[0, 16, 16]), GOOD_DATA, "'w': data_offsets"),
    (good_header(data_offsets={"0": 16}), GOOD_DATA, "'w': data_offsets"),
    (good_header(dtype=None), GOOD_DATA, "'w': unknown dtype None"),
    (good_header(dtype=["F32"]), GOOD_DATA, "'w': unknown dtype"),
    (good_header(dtype="f32"), GOOD_DATA, "'w': unknown dtype 'f32'"),
    ({"w": {"shape": [2, 2], "data_offsets": [0, 16]}}, GOOD_DATA, "'w': unknown dtype None"),
    # the integer-digits limit is a ValueError, not a JSONDecodeError
    (
        b'{"w": {"dtype": "F32", "shape": [1' + b"0" * 5000 + b'], "data_offsets": [0, 16]}}',
        GOOD_DATA,
        "header is not valid JSON",
    ),
    (
        b'{"w": {"dtype": "F32", "shape": [Infinity], "data_offsets": [0, 16]}}',
        GOOD_DATA,
        "header is not valid JSON",
    ),
    (
        b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16], "x": NaN}}',
        GOOD_DATA,
        "header is not valid JSON",
    ),
    (
        b'{"w": {"dtype": "F32", "shape": [1e999], "data_offsets": [0, 16]}}',
        GOOD_DATA,
        "'w': shape [inf]",
    ),
    (b"[" * 100_000 + b"]" * 100_000, GOOD_DATA, "header is not valid JSON"),
    (
        b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, "w": {"dtype": "F32", '
        b'"shape": [4], "data_offsets": [0, 16]}}',
        GOOD_DATA,
        "header repeats the key 'w'",
    ),
    (
        b'{"w": {"dtype": "F16", "dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}',
        GOOD_DATA,
        "header repeats the key 'dtype'",
    ),
    ({**good_header(), "__metadata__": {"format": 1}}, GOOD_DATA, "__metadata__ is not an obj"),
    ({**good_header(), "__metadata__": []}, GOOD_DATA, "__metadata__ is not an object"),
    (
        {**good_header(), "v": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}},
        GOOD_DATA,
        "overlap",
    ),
]


@pytest.mark.parametrize(
    ("header", "data", "message"), MALFORMED, ids=[case[2] for case in MALFORMED]
)
def test_malformed_headers_raise_checkpoint_error_naming_file_and_tensor(
    tmp_path, header, data, message
):
    path = raw_file(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(CheckpointError, match=re.escape(message)) as info:
        SafetensorsFile(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"\x10\0\0",
        struct.pack("<Q", 1000) + b"{}",  # header length beyond the file
        struct.pack("<Q", 2**63) + b"{}",  # absurd header length: must not be allocated
    ],
)
def test_truncated_or_oversized_header_length(tmp_path, content):
    path = tmp_path / "t.safetensors"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match="header length|truncated") as info:
        SafetensorsFile(path)
    assert str(path) in str(info.value)


def test_long_names_and_values_are_cut_in_messages(tmp_path):
    """A megabyte tensor name or a 4,000-digit integer is not echoed whole."""
    path = raw_file(tmp_path / "x.safetensors", {"x" * 10**6: {**good_header()["w"], "dtype": 5}})
    with pytest.raises(CheckpointError) as info:
        SafetensorsFile(path)
    assert str(path) in str(info.value) and len(str(info.value)) < 500
    path = raw_file(tmp_path / "y.safetensors", good_header(shape=[0, 10**4000]), b"")
    with pytest.raises(CheckpointError, match="'w': shape") as info:
        SafetensorsFile(path)
    assert len(str(info.value)) < 500


def test_metadata_null_and_padding_are_accepted(tmp_path):
    header = json.dumps({**good_header(), "__metadata__": None}).encode() + b"        "
    file = SafetensorsFile(raw_file(tmp_path / "x.safetensors", header, GOOD_DATA))
    np.testing.assert_array_equal(file.tensor("w"), [[0, 1], [2, 3]])


def test_truncated_data_section(tmp_path):
    path = raw_file(tmp_path / "t.safetensors", good_header(), GOOD_DATA[:10])
    with pytest.raises(CheckpointError, match="'w': data_offsets"):
        SafetensorsFile(path)


def test_missing_tensor_and_unconvertible_dtype_name_the_tensor(tmp_path):
    header = {**good_header(), "steps": {"dtype": "I64", "shape": [1], "data_offsets": [16, 24]}}
    path = raw_file(tmp_path / "model.safetensors", header, GOOD_DATA + bytes(8))
    checkpoint = Checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match=r"model.safetensors, tensor 'steps': dtype I64"):
        checkpoint.tensor("steps")
    with pytest.raises(CheckpointError, match="no tensor 'lm_head.weight'"):
        checkpoint.tensor("lm_head.weight")
    with pytest.raises(CheckpointError, match=r"tensor 'w': shape \[2, 2\], the config needs"):
        checkpoint.tensor("w", (4,))
    np.testing.assert_array_equal(checkpoint.tensor("w", (2, 2)), [[0, 1], [2, 3]])
    assert path.exists()


def test_checkpoint_directory_problems(tmp_path):
    with pytest.raises(CheckpointError, match="neither model.safetensors"):
        Checkpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"x": "../x"}}')
    with pytest.raises(CheckpointError, match="bad shard file name"):
        Checkpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"x": "a.st"}}')
    with pytest.raises(CheckpointError, match="a.st: cannot read"):
        Checkpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("[]")
    with pytest.raises(CheckpointError, match="not a JSON object"):
        Checkpoint(tmp_path)
    index = tmp_path / "model.safetensors.index.json"
    for text, message in [
        ('{"weight_map": {"x": "a\\u0000b"}}', "bad shard file name 'a\\x00b'"),
        ('{"weight_map": {"x": 5}}', "tensor 'x': bad shard file name 5"),
        ('{"weight_map": {"x": "/etc/passwd"}}', "bad shard file name '/etc/passwd'"),
        ('{"weight_map": {"x": ".."}}', "bad shard file name '..'"),
        ('{"weight_map": []}', "no 'weight_map' object"),
        ("{}", "no 'weight_map' object"),
        ('{"weight_map": {}, "weight_map": {"x": "a.st"}}', "repeats the key 'weight_map'"),
        ('{"total_size": 1' + "0" * 5000 + ', "weight_map": {}}', "not valid JSON"),
        ("\ufeff{}", "not valid JSON"),
    ]:
        index.write_text(text)
        with pytest.raises(CheckpointError, match=re.escape(f"{index}")) as info:
            Checkpoint(tmp_path)
        assert message in str(info.value), (text, str(info.value))


def test_index_naming_a_tensor_its_shard_lacks_names_the_shard(tmp_path):
    save_file({"x": np.ones(2, dtype=np.float32)}, tmp_path / "a.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(
        '{"weight_map": {"x": "a.safetensors", "y": "a.safetensors"}}'
    )
    checkpoint = Checkpoint(tmp_path)
    np.testing.assert_array_equal(checkpoint.tensor("x"), [1, 1])
    with pytest.raises(
        CheckpointError, match=re.escape(f"{tmp_path / 'a.safetensors'}, tensor 'y'")
    ):
        checkpoint.tensor("y")


def test_read_config_errors(tmp_path):
    with pytest.raises(CheckpointError, match="config.json: cannot read"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(CheckpointError, match="config.json: not valid JSON"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert read_config(tmp_path) == {"model_type": "llama"}


# -- fuzzing ---------------------------------------------------------------------------------------


def valid_file_bytes():
    rng = np.random.default_rng(1)
    tensors = {
        "a": rng.standard_normal((2, 3)).astype(np.float32),
        "b": rng.standard_normal(5).astype(np.float16),
        "c": rng.standard_normal((1, 4)).astype(np.float32),
    }
    header = {}
    data = b""
    for name, array in tensors.items():
        dtype = {np.float32: "F32", np.float16: "F16"}[array.dtype.type]
        raw = array.astype(array.dtype.newbyteorder("<")).tobytes()
        header[name] = {
            "dtype": dtype,
            "shape": list(array.shape),
            "data_offsets": [len(data), len(data) + len(raw)],
        }
        data += raw
    return header, data, tensors


HEADER, DATA, TENSORS = valid_file_bytes()

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=6,
)


@st.composite
def mutated_files(draw):
    """A valid file, then one kind of damage: a field replaced, bytes flipped, or truncation."""
    header = json.loads(json.dumps(HEADER))
    data = DATA
    kind = draw(st.sampled_from(["field", "flip", "truncate", "length"]))
    if kind == "field":
        entry = header[draw(st.sampled_from(sorted(header)))]
        key = draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
        entry[key] = draw(
            json_values
            | st.sampled_from(["F64", "BF16", "I8", "F8_E4M3", "F16"])
            | st.lists(st.integers(-2, 40), max_size=3)
        )
    content = bytearray(struct.pack("<Q", len(json.dumps(header))) + json.dumps(header).encode())
    content += data
    if kind == "flip":
        for _ in range(draw(st.integers(1, 4))):
            position = draw(st.integers(0, len(content) - 1))
            content[position] = draw(st.integers(0, 255))
    elif kind == "truncate":
        content = content[: draw(st.integers(0, len(content) - 1))]
    elif kind == "length":
        content[:8] = struct.pack("<Q", draw(st.integers(0, 2**64 - 1)))
    return bytes(content)


@settings(
    deadline=None, max_examples=300, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(content=mutated_files())
def test_fuzzed_files_give_tensors_or_checkpoint_error(tmp_path, content):
    path = tmp_path / "fuzz.safetensors"
    path.write_bytes(content)
    try:
        file = SafetensorsFile(path)
        tensors = {name: file.tensor(name) for name in file.names}
    except CheckpointError as exc:
        assert str(path) in str(exc)
        event("CheckpointError")
        return
    event("loaded")
    for name, values in tensors.items():
        assert values.dtype == np.float32 and values.shape == file.shape(name)


# -- non-finite weights ----------------------------------------------------------------------------

STORIES = Path(__file__).resolve().parents[1] / "models" / "stories260K"

float_arrays = st.integers(0, 40).flatmap(
    lambda n: st.lists(
        st.floats(width=32, allow_nan=False, allow_infinity=False)
        | st.sampled_from([3.0e38, -3.0e38, 65504.0]),  # finite, but their sum overflows
        min_size=n,
        max_size=n,
    )
)


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    values=float_arrays,
    poison=st.lists(
        st.tuples(st.integers(0, 39), st.sampled_from([np.nan, np.inf, -np.inf])), max_size=3
    ),
    dtype=st.sampled_from(["F32", "F16", "BF16"]),
)
def test_non_finite_values_are_refused_naming_the_tensor_unless_allowed(
    tmp_path, values, poison, dtype
):
    array = np.array(values, dtype=np.float32)
    for index, value in poison:
        if index < array.size:
            array[index] = value
    if dtype == "F16":
        with np.errstate(over="ignore"):
            stored = array.astype("<f2")  # large float32 values become inf here: poison too
        raw, expected = stored.tobytes(), stored.astype(np.float32)
    elif dtype == "BF16":
        bits = (array.view(np.uint32) >> 16).astype("<u2")
        raw, expected = bits.tobytes(), (bits.astype(np.uint32) << 16).view(np.float32)
    else:
        raw, expected = array.astype("<f4").tobytes(), array
    header = {"w.weight": {"dtype": dtype, "shape": [array.size], "data_offsets": [0, len(raw)]}}
    path = raw_file(tmp_path / "model.safetensors", header, raw)
    # Allowed (and the default of the raw reader): the stored values, bit for bit.
    out = SafetensorsFile(path).tensor("w.weight")
    assert out.tobytes() == expected.tobytes()
    bad = int((~np.isfinite(expected)).sum())
    if bad:
        with pytest.raises(CheckpointError) as info:
            Checkpoint(tmp_path).tensor("w.weight", require_finite=True)
        message = str(info.value)
        assert f"{path}, tensor 'w.weight': {bad} of {array.size} values are NaN or inf" in message
        assert "allow_non_finite_weights=True" in message
    else:
        required = Checkpoint(tmp_path).tensor("w.weight", require_finite=True)
        assert required.tobytes() == expected.tobytes()


@pytest.fixture
def stories_copy(tmp_path):
    """A writable copy of stories260K, and its tensors to poison."""
    for name in [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]:
        shutil.copyfile(STORIES / name, tmp_path / name)
    return tmp_path, load_file(STORIES / "model.safetensors")


@pytest.mark.parametrize(
    ("name", "index", "value"),
    [
        ("model.layers.3.self_attn.k_proj.weight", (2, 5), np.nan),
        ("model.embed_tokens.weight", (511, 0), np.inf),
        ("model.norm.weight", (0,), -np.inf),
    ],
)
def test_model_refuses_a_checkpoint_with_a_non_finite_weight_unless_allowed(
    stories_copy, name, index, value
):
    directory, tensors = stories_copy
    tensors[name][index] = value
    save_file(tensors, directory / "model.safetensors")
    with pytest.raises(
        CheckpointError, match=re.escape(f"model.safetensors, tensor '{name}': 1 of")
    ):
        Model.from_pretrained(directory)
    model = Model.from_pretrained(directory, allow_non_finite_weights=True)
    weights = model.weights
    parts = [weights.embed, weights.final_norm] + [
        part for layer in weights.layers for part in vars(layer).values() if part is not None
    ]
    arrays = [getattr(part, "weight", part) for part in parts]  # a Linear's weight
    assert sum(int((~np.isfinite(array)).sum()) for array in arrays) == 1  # loaded as stored


def test_finite_check_costs_little_at_load(stories_copy):
    """Measured: on stories260K the check adds well under a millisecond (a float32 sum per
    tensor, falling back to isfinite only when the sum overflows)."""
    directory, tensors = stories_copy
    save_file(tensors, directory / "model.safetensors")
    config = ModelConfig.from_pretrained(directory)

    def best(allow: bool) -> float:
        times = []
        for _ in range(15):
            start = time.perf_counter()
            load_weights(Checkpoint(directory), config, allow_non_finite_weights=allow)
            times.append(time.perf_counter() - start)
        return min(times)

    unchecked, checked = best(True), best(False)
    assert checked < 3 * unchecked + 0.005, (checked, unchecked)
