"""int4 and int8 weights (mie.linear.quantize_int4, quantize_int8) against llama.cpp's Q4_0
and Q8_0 references, byte for byte.

The oracle is ``gguf.quants`` (llama.cpp's own Python port of ``quantize_row_q4_0_ref``,
``quantize_row_q8_0_ref`` and their dequantizers): for random matrices -- normal values at
many magnitudes, all-zero blocks, ties (values exactly half a step between two codes), a
negative or a positive largest value, equal magnitudes of both signs, huge values up to the
float16 scale's limit and tiny ones whose scale underflows -- the 18-byte (34-byte) blocks
reassembled from mie's codes and scales are ``gguf.quants.quantize(w, Q4_0)``'s
(``Q8_0``'s) bytes, and ``dequantize_int4`` (``dequantize_int8``) is
``gguf.quants.dequantize``'s values.
"""

from pathlib import Path

import numpy as np
import pytest
from conftest import backend_named
from hypothesis import given, settings
from hypothesis import strategies as st

from mie import LLM, SamplingParams, linear
from mie.bench import accuracy
from mie.model import Model, ModelConfig
from tests.test_linear import rounded_activation

gguf_quants = pytest.importorskip("gguf.quants")
Q4_0 = pytest.importorskip("gguf").GGMLQuantizationType.Q4_0
Q8_0 = pytest.importorskip("gguf").GGMLQuantizationType.Q8_0

BLOCK = linear.GROUP_SIZE


def q4_0_blocks(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """mie's int4 arrays as llama.cpp's Q4_0 rows: per block, the float16 scale's 2 bytes
    (little-endian) then the 16 bytes of packed codes -- ``(N, K / 32 * 18)`` uint8."""
    n, groups = scales.shape
    scale_bytes = scales.astype("<f2").view(np.uint8).reshape(n, groups, 2)
    code_bytes = codes.reshape(n, groups, linear.INT4_BLOCK_BYTES)
    return np.concatenate([scale_bytes, code_bytes], axis=2).reshape(n, groups * 18)


def block_values(kind: str, rng: np.random.Generator) -> np.ndarray:
    """32 float32 weights of one kind of block."""
    if kind in Q8_0_KINDS:
        return q8_0_edge_block(kind, rng)
    if kind == "zeros":
        return np.zeros(BLOCK, np.float32)
    if kind == "ties":  # a largest value of +-8 * 2^e makes d = -+2^e: halves are exact ties
        e = float(rng.integers(-20, 12))
        values = rng.integers(-15, 16, BLOCK) / 2 * 2**e
        values[rng.integers(BLOCK)] = rng.choice([-8.0, 8.0]) * 2**e
        return values.astype(np.float32)
    if kind == "both_signs":  # the same largest magnitude with both signs: the first one wins
        values = rng.standard_normal(BLOCK).astype(np.float32) * 0.1
        i, j = rng.choice(BLOCK, 2, replace=False)
        values[i], values[j] = 1.0, -1.0
        return values
    scale = {"normal": 1.0, "huge": 6e4, "small": 1e-6, "tiny": 1e-30}[kind]
    values = rng.standard_normal(BLOCK) * scale
    if kind == "huge":
        values = np.clip(values, -5.2e5, 5.2e5)  # below the float16 scale's overflow
    return values.astype(np.float32)


KINDS = ("normal", "zeros", "ties", "both_signs", "huge", "small", "tiny")
Q8_0_KINDS = ("q8_ties", "q8_near")
"""Blocks at Q8_0's own rounding edges (``q8_0_edge_block``)."""


@st.composite
def matrices(draw, kinds_drawn: tuple[str, ...] = KINDS) -> np.ndarray:
    """(N, K) float32, K a multiple of 32, each block of one of ``kinds_drawn`` (mixed within
    a row)."""
    n = draw(st.integers(1, 6))
    groups = draw(st.integers(1, 5))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kinds = draw(st.lists(st.sampled_from(kinds_drawn), min_size=n * groups, max_size=n * groups))
    blocks = [block_values(kind, rng) for kind in kinds]
    return np.concatenate(blocks).reshape(n, groups * BLOCK)


@settings(max_examples=300)
@given(matrices())
def test_codes_and_scales_are_llama_cpp_q4_0_bytes(w):
    codes, scales = linear.quantize_int4(w)
    n, k = w.shape
    assert codes.dtype == np.uint8 and codes.shape == (n, k // 2) and codes.flags.c_contiguous
    assert scales.dtype == np.float16 and scales.shape == (n, k // BLOCK)
    theirs = gguf_quants.quantize(w, Q4_0)
    np.testing.assert_array_equal(q4_0_blocks(codes, scales), theirs)
    np.testing.assert_array_equal(
        linear.dequantize_int4(codes, scales), gguf_quants.dequantize(theirs, Q4_0)
    )


def q8_0_blocks(q: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """mie's int8 arrays as llama.cpp's Q8_0 rows: per block, the float16 scale's 2 bytes
    (little-endian) then the 32 codes -- ``(N, K / 32 * 34)`` uint8."""
    n, groups = scales.shape
    scale_bytes = scales.astype("<f2").view(np.uint8).reshape(n, groups, 2)
    code_bytes = q.view(np.uint8).reshape(n, groups, BLOCK)
    return np.concatenate([scale_bytes, code_bytes], axis=2).reshape(n, groups * 34)


def q8_0_edge_block(kind: str, rng: np.random.Generator) -> np.ndarray:
    """32 float32 weights at Q8_0's rounding edges. "q8_ties": the largest value 127 * 2^e
    makes d = 2^e exactly, and values (n + 0.5) * 2^e are exact ties (roundf takes them away
    from zero, rint to even). "q8_near": values within an ulp or two of (n + 0.5) * d for an
    arbitrary d, where w * (1 / d) and w / d can round to different codes."""
    if kind == "q8_ties":
        e = float(rng.integers(-20, 12))
        values = (rng.integers(-253, 254, BLOCK) / 2 * 2**e).astype(np.float32)
        values[rng.integers(BLOCK)] = rng.choice([-127.0, 127.0]) * 2**e
        return values
    d = np.float32(rng.uniform(0.5, 2.0) * 2.0 ** rng.integers(-20, 12))
    halves = ((rng.integers(-127, 127, BLOCK) + 0.5) * d).astype(np.float32)
    values = halves
    for _ in range(2):  # each value nudged 0, 1 or 2 ulps either way
        values = np.where(
            rng.random(BLOCK) < 0.5, values, np.nextafter(values, rng.choice([-1, 1]) * np.inf)
        )
    values = values.astype(np.float32)
    values[rng.integers(BLOCK)] = np.float32(127) * d
    return values


@settings(max_examples=300)
@given(matrices((*KINDS, *Q8_0_KINDS)))
def test_int8_codes_and_scales_are_llama_cpp_q8_0_bytes(w):
    q, scales = linear.quantize_int8(w)
    n, k = w.shape
    assert q.dtype == np.int8 and q.shape == (n, k) and q.flags.c_contiguous
    assert scales.dtype == np.float16 and scales.shape == (n, k // BLOCK)
    theirs = gguf_quants.quantize(w, Q8_0)
    np.testing.assert_array_equal(q8_0_blocks(q, scales), theirs)
    np.testing.assert_array_equal(
        linear.dequantize_int8(q, scales), gguf_quants.dequantize(theirs, Q8_0)
    )


def test_rounding_example():
    """A block whose largest magnitude is -8 has d = 1: codes are trunc(w + 8.5), so halves
    round up (towards +inf), -8 is code 0 and +8 saturates at code 15 (+7)."""
    w = np.zeros((1, BLOCK), np.float32)
    w[0, :8] = [-8.0, 0.5, 1.5, -0.5, -1.5, 7.5, 8.0, 2.25]
    codes, scales = linear.quantize_int4(w)
    assert scales[0, 0] == 1.0
    values = linear.int4_codes(codes)[0]
    np.testing.assert_array_equal(values[:8], [-8, 1, 2, 0, -1, 7, 7, 2])
    np.testing.assert_array_equal(values[8:], 0)  # zeros: code 8


def test_the_scale_takes_the_sign_of_the_largest_value():
    w = np.zeros((2, BLOCK), np.float32)
    w[0, 3], w[1, 3] = 4.0, -4.0
    codes, scales = linear.quantize_int4(w)
    np.testing.assert_array_equal(scales[:, 0], [-0.5, 0.5])
    np.testing.assert_array_equal(linear.int4_codes(codes)[:, 3], [-8, -8])  # both exact


def test_packing_low_nibble_is_input_j_high_nibble_is_input_j_plus_16():
    w = np.zeros((1, BLOCK), np.float32)
    w[0, 0], w[0, 16], w[0, 1] = -8.0, 7.0, 1.0  # d = 1: codes 0, 15, 9
    codes, _ = linear.quantize_int4(w)
    assert codes[0, 0] == 0x00 | (15 << 4)
    assert codes[0, 1] == 9 | (8 << 4)


def test_zero_and_underflowing_blocks_store_zeros():
    w = np.zeros((2, 2 * BLOCK), np.float32)
    w[1, 40] = 1e-39  # float32 subnormal: 1 / d overflows; float16 scale 0
    codes, scales = linear.quantize_int4(w)
    np.testing.assert_array_equal(scales, 0)
    np.testing.assert_array_equal(codes, 0x88)
    np.testing.assert_array_equal(linear.dequantize_int4(codes, scales), 0)


@pytest.mark.parametrize(
    "w, message",
    [
        (np.zeros((2, 33), np.float32), "K = 33 inputs per row is not a multiple of 32"),
        (np.zeros((2, 16), np.float32), "K = 16 inputs"),
        (np.zeros(64, np.float32), "2-D weight"),
        (np.full((1, 32), np.nan, np.float32), "NaN or infinite"),
        (np.full((1, 32), 6e5, np.float32), "scale overflows float16"),
    ],
)
def test_quantize_int4_refuses(w, message):
    with pytest.raises(ValueError, match=message):
        linear.quantize_int4(w)


def test_int4_weights_in_matmul_and_widen():
    """uint8 codes are int4 (K twice their columns), with float16 scales; the product is x,
    rounded to int8 blocks, times the dequantized weight."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((5, 96)).astype(np.float32)
    codes, scales = linear.quantize_int4(w)
    assert linear.weight_format(codes) == "int4" and linear.input_size(codes) == 96
    wide = gguf_quants.dequantize(gguf_quants.quantize(w, Q4_0), Q4_0)
    np.testing.assert_array_equal(linear.widen(codes, scales), wide)
    x = rng.standard_normal((3, 96)).astype(np.float32)
    seen = rounded_activation(x)
    exact = seen @ wide.astype(np.float64).T
    bound = np.abs(seen) @ np.abs(wide).T
    assert (np.abs(linear.matmul(x, codes, scales) - exact) <= 1e-5 * bound).all()


def test_empty_shapes():
    codes, scales = linear.quantize_int4(np.zeros((4, 0), np.float32))
    assert codes.shape == (4, 0) and scales.shape == (4, 0)
    np.testing.assert_array_equal(linear.matmul(np.ones((3, 0), np.float32), codes, scales), 0)
    codes, scales = linear.quantize_int4(np.zeros((0, 64), np.float32))
    assert codes.shape == (0, 32) and scales.shape == (0, 2)
    assert linear.matmul(np.ones((3, 64), np.float32), codes, scales).shape == (3, 0)


@pytest.mark.parametrize(
    "fmt, codes, dequantize",
    [  # 32 rows, 3 blocks of codes numbered so that no two bytes of a row's block repeat
        ("int4x16", (np.arange(32 * 48).reshape(32, 48) * 7 % 256).astype(np.uint8),
         linear.dequantize_int4),
        ("int8x16", (np.arange(32 * 96).reshape(32, 96) * 7 % 256 - 128).astype(np.int8),
         linear.dequantize_int8),
    ],
)  # fmt: skip
def test_row_groups_hold_16_rows_of_each_block_byte_by_byte(fmt, codes, dequantize):
    """Every byte and scale of ``group_rows``'s layout, at the place the module docstring
    gives it (element (g, b), byte 64 c + 4 r + t: byte 4 c + t of row 16 g + r's block b --
    int4's inputs 4 c + t and 16 + 4 c + t, int8's input 4 c + t; scale 16 b + r), read back
    by ``ungroup_rows``, ``widen`` and ``matmul`` alike."""
    n, block_bytes = 32, codes.shape[1] // 3
    scales = (np.arange(n * 3).reshape(n, 3) / 64 + 0.5).astype(np.float16)
    grouped, grouped_scales = linear.group_rows(codes, scales)
    assert grouped.dtype == linear.GROUPED_DTYPES[fmt] and grouped.shape == (2, 3)
    assert grouped_scales.shape == (2, 48) and linear.weight_format(grouped) == fmt
    assert linear.input_size(grouped) == 96 and linear.output_size(grouped) == n
    raw = grouped.view(codes.dtype).reshape(2, 3, 16 * block_bytes)
    for g in range(2):
        for b in range(3):
            for r in range(16):
                assert grouped_scales[g, 16 * b + r] == scales[16 * g + r, b]
                for c in range(block_bytes // 4):
                    for t in range(4):
                        byte = codes[16 * g + r, block_bytes * b + 4 * c + t]
                        assert raw[g, b, 64 * c + 4 * r + t] == byte
    back = linear.ungroup_rows(grouped, grouped_scales)
    assert back[0].dtype == codes.dtype
    np.testing.assert_array_equal(back[0], codes)
    np.testing.assert_array_equal(back[1], scales)
    wide = dequantize(codes, scales)
    np.testing.assert_array_equal(linear.widen(grouped, grouped_scales), wide)
    x = np.random.default_rng(0).standard_normal((3, 96)).astype(np.float32)
    np.testing.assert_array_equal(
        linear.matmul(x, grouped, grouped_scales), linear.matmul(x, codes, scales)
    )


@settings(max_examples=50)
@given(st.integers(0, 3), st.integers(0, 4), st.integers(0, 2**32 - 1))
def test_group_rows_and_ungroup_rows_are_inverses(groups, blocks, seed):
    rng = np.random.default_rng(seed)
    scales = rng.standard_normal((16 * groups, blocks)).astype(np.float16)
    int6_values = rng.standard_normal((16 * groups, 32 * blocks)).astype(np.float32)
    pairs = blocks - blocks % 2  # int6: whole pairs of blocks
    for codes, row_scales in (
        (rng.integers(0, 256, (16 * groups, 16 * blocks), dtype=np.uint8), scales),  # int4
        (rng.integers(-128, 128, (16 * groups, 32 * blocks), dtype=np.int8), scales),  # int8
        linear.quantize_int6(int6_values[:, : 32 * pairs]),
        (rng.integers(0, 2**16, (16 * groups, 32 * blocks), dtype=np.uint16), None),  # bfloat16
    ):
        back = linear.ungroup_rows(*linear.group_rows(codes, row_scales))
        assert back[0].dtype == codes.dtype
        np.testing.assert_array_equal(back[0].view(np.uint8), codes.view(np.uint8))
        if row_scales is None:
            assert back[1] is None
        else:
            np.testing.assert_array_equal(back[1], row_scales)


@settings(max_examples=50)
@given(
    st.sampled_from(sorted(linear.GROUPED)),
    st.integers(1, 3),
    st.lists(st.integers(0, 47), max_size=20),
    st.integers(0, 2**32 - 1),
)
def test_gather_rows_of_a_row_grouped_weight_are_its_rows(fmt, pairs, ids, seed):
    """The embedding lookup: rows ``ids`` (repeats and none included) of an int4x16, int8x16,
    int6x16 or bfloat16x16 weight are those rows of the weight it groups, widened."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((48, 64 * pairs), dtype=np.float32)
    quantize = {
        "int4": linear.quantize_int4,
        "int8": linear.quantize_int8,
        "int6": linear.quantize_int6,
        "bfloat16": lambda w: (linear.to_bfloat16(w), None),
    }[fmt]
    codes, scales = quantize(w)
    grouped = linear.group_rows(codes, scales)
    ids = np.array(ids, dtype=np.int64)
    expected = linear.widen(codes, scales)[ids]
    np.testing.assert_array_equal(linear.gather_rows(*grouped, ids), expected)
    np.testing.assert_array_equal(linear.gather_rows(codes, scales, ids), expected)


def test_group_rows_refuses_what_is_not_whole_groups_of_quantized_rows():
    with pytest.raises(ValueError, match="int4x16 groups whole sets of 16 rows, got 8 rows"):
        linear.group_rows(np.zeros((8, 16), np.uint8), np.ones((8, 1), np.float16))
    with pytest.raises(ValueError, match="int8x16 takes whole blocks of 32 inputs, got K = 40"):
        linear.group_rows(*linear.quantize_int8(np.ones((16, 40), np.float32)))
    with pytest.raises(ValueError, match="int6x16 groups whole sets of 16 rows, got 24 rows"):
        linear.group_rows(*linear.quantize_int6(np.ones((24, 64), np.float32)))
    with pytest.raises(ValueError, match="bfloat16x16 groups whole sets of 16 rows, got 8 rows"):
        linear.group_rows(linear.to_bfloat16(np.ones((8, 64), np.float32)))
    with pytest.raises(ValueError, match="takes int4 .uint8., int8, int6 or bfloat16 weights"):
        linear.group_rows(np.ones((16, 64), np.float16))
    with pytest.raises(ValueError, match="scales belong to"):
        bits = linear.to_bfloat16(np.ones((16, 64), np.float32))
        linear.group_rows(bits, np.ones((16, 2), np.float16))


def bad_int4_arguments():
    """(x, codes, scales, exception, message) that matmul refuses for int4 weights (also
    used by tests/test_fast_linear.py)."""
    x = np.ones((2, 64), np.float32)
    codes = np.zeros((3, 32), np.uint8)
    scales = np.ones((3, 2), np.float16)
    grouped = np.zeros((1, 2), linear.INT4X16_DTYPE)  # int4x16: 16 rows, 64 inputs
    grouped_scales = np.ones((1, 32), np.float16)
    return [
        (x, codes, None, ValueError, "int4 weight needs its scales"),
        (x, codes, scales.astype(np.float32), TypeError, "int4 scales must be a float16"),
        (x, codes, np.ones((3, 1), np.float16), ValueError, r"must have shape \(3, 2\)"),
        (x, np.zeros((3, 24), np.uint8), scales, ValueError, "whole blocks of 16 bytes"),
        (np.ones((2, 32), np.float32), codes, scales, ValueError, r"\(N, K\) = \(3, 64\)"),
        (x, grouped, np.ones((1, 16), np.float16), ValueError, r"must have shape \(1, 32\)"),
        (x, grouped, None, ValueError, "int4x16 weight needs its scales"),
        (np.ones((2, 32), np.float32), grouped, grouped_scales, ValueError, r"= \(16, 64\)"),
    ]


@pytest.mark.parametrize("x, codes, scales, error, message", bad_int4_arguments())
def test_matmul_refuses_bad_int4_arguments(x, codes, scales, error, message):
    with pytest.raises(error, match=message):
        linear.matmul(x, codes, scales)


# -- int4 models: quantization="int4" ---------------------------------------------------------

STORIES = Path(__file__).resolve().parents[1] / "models" / "stories260K"
QWEN2_TINY = ModelConfig(  # Qwen2-shaped, every input dimension whole Q4_0 blocks
    architecture="qwen2",
    vocab_size=256,
    hidden_size=128,
    intermediate_size=320,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
)
TINY_BOUND = {"int8": 0.02, "int4": 0.3}
"""The largest teacher-forced logit error relative to float32's largest logit on
``QWEN2_TINY`` (4 prompts of 32 random tokens, seed 0): measured 0.011 for int8 and 0.14
for int4 (its embedding int6) on the python and fast backends; the bound is about twice
that."""


def embeddings_of(weights) -> list:
    """The embedding, and the LM head when it is a matrix of its own (not tied)."""
    return [weights.embed] + ([] if weights.lm_head is weights.embed else [weights.lm_head])


def layer_matrices_of(weights) -> list:
    return [
        getattr(layer, name) for layer in weights.layers for name in ("qkv", "o", "gate_up", "down")
    ]


def matrices_of(weights) -> list:
    """Every weight matrix, the LM head once (none of its own when tied)."""
    return embeddings_of(weights) + layer_matrices_of(weights)


def int8_bytes(n: int, k: int) -> int:
    """An int8 matrix: a byte a weight, and a float16 scale per (partial) group of 32."""
    return n * (k + 2 * -(-k // 32))


def test_random_int4_model_holds_llama_cpp_q4_0_of_the_float32_values():
    model = Model.random(QWEN2_TINY, seed=3, quantization="int4")
    reference = Model.random(QWEN2_TINY, seed=3)
    assert model.weights.format == "int4"
    assert model.weights.num_parameters == reference.weights.num_parameters
    quantized = 0
    layers = zip(
        layer_matrices_of(model.weights), layer_matrices_of(reference.weights), strict=True
    )
    for ours, wide in layers:  # every layer matrix whole groups of 16 rows: int4x16
        assert ours.format == "int4x16" and ours.scales.dtype == np.float16
        theirs = gguf_quants.quantize(wide.weight, Q4_0)
        codes, scales = linear.ungroup_rows(ours.weight, ours.scales)
        np.testing.assert_array_equal(q4_0_blocks(codes, scales), theirs)
        quantized += wide.weight.size * 18 // 32
    # the embedding (tied: also the LM head) is int6, its 256 rows in int6x16: 26 bytes per
    # 32 weights
    for ours, wide in zip(
        embeddings_of(model.weights), embeddings_of(reference.weights), strict=True
    ):
        assert ours.format == "int6x16"
        q, scales = linear.ungroup_rows(ours.weight, ours.scales)
        theirs_q, theirs_scales = linear.quantize_int6(wide.weight)
        np.testing.assert_array_equal(q.view(np.uint8), theirs_q.view(np.uint8))
        np.testing.assert_array_equal(scales, theirs_scales)
        quantized += wide.weight.size * 26 // 32
    unquantized = (
        sum(  # norms and biases, float32
            a.nbytes
            for layer in model.weights.layers
            for a in (layer.input_norm, layer.post_norm, layer.qkv_bias)
        )
        + model.weights.final_norm.nbytes
    )
    assert model.weights.nbytes == quantized + unquantized


def test_stories260k_int4_bytes_and_its_int8_down_projection():
    """stories260K's down projection has 172 inputs, not whole blocks: stored int8; the
    embedding (64 inputs, 512 rows) int6 in int6x16, 26 bytes per 32 weights; every other
    matrix int4, at Q4_0's
    18 bytes per 32 weights -- in int4x16 where its rows are whole groups of 16 (q/k/v: 128,
    o: 64), as they are where not (gate/up: 344)."""
    model = Model.from_pretrained(STORIES, quantization="int4")
    wide = Model.from_pretrained(STORIES)
    assert model.weights.format == "int4"
    bound, formats = 0, set()
    embeddings = [id(m) for m in embeddings_of(model.weights)]
    for ours, theirs in zip(matrices_of(model.weights), matrices_of(wide.weights), strict=True):
        n, k = theirs.weight.shape
        if id(ours) in embeddings:
            assert ours.format == "int6x16"
            codes, scales = linear.group_rows(*linear.quantize_int6(theirs.weight))
            np.testing.assert_array_equal(ours.weight.view(np.uint8), codes.view(np.uint8))
            np.testing.assert_array_equal(ours.scales, scales)
            bound += n * k * 26 // 32
        elif k % 32:
            assert ours.format == "int8"
            np.testing.assert_array_equal(ours.weight, linear.quantize_int8(theirs.weight)[0])
            bound += ours.nbytes  # int8: 1 byte a weight + 4 per (partial) group of 32
        else:
            assert ours.format == ("int4" if n % 16 else "int4x16")
            formats.add(ours.format)
            codes, scales = linear.quantize_int4(theirs.weight)
            if ours.format == "int4x16":
                codes, scales = linear.group_rows(codes, scales)
            np.testing.assert_array_equal(ours.weight.view(np.uint8), codes.view(np.uint8))
            np.testing.assert_array_equal(ours.scales, scales)
            bound += n * k * 18 // 32
        per_32 = {"int4": 18, "int4x16": 18, "int6x16": 26}
        assert ours.nbytes <= (
            int8_bytes(n, k) if ours.format == "int8" else n * k * per_32[ours.format] // 32
        )
    assert formats == {"int4", "int4x16"}
    floats = wide.weights.nbytes - sum(m.nbytes for m in matrices_of(wide.weights))
    assert model.weights.nbytes == bound + floats
    assert model.weights.nbytes < wide.weights.nbytes / 4


@pytest.mark.parametrize("backend", ["python", "fast"])
def test_int4_logits_are_within_their_bound_on_a_qwen2_shaped_model(backend):
    backend = backend_named(backend)
    rng = np.random.default_rng(0)
    texts = rng.integers(0, QWEN2_TINY.vocab_size, (4, 32)).tolist()
    reference = accuracy.teacher_forced_logits(
        Model.random(QWEN2_TINY, 0, backend.kernels), backend, texts, "float32"
    )
    errors = {}
    for quantization, bound in TINY_BOUND.items():
        model = Model.random(QWEN2_TINY, 0, backend.kernels, quantization=quantization)
        logits = accuracy.teacher_forced_logits(model, backend, texts, "float32")
        errors[quantization] = accuracy.compare_logits(reference, logits)["relative_error"]
        assert 0 < errors[quantization] <= bound, errors
    assert errors["int4"] > 5 * errors["int8"]  # 4 bits are what was stored


@pytest.mark.parametrize("backend", ["python", "fast"])
def test_llm_generates_text_with_int4_weights(backend):
    backend_named(backend)
    llm = LLM(STORIES, quantization="int4", backend=backend)
    assert llm.engine.model.weights.format == "int4"
    params = SamplingParams(max_tokens=24, temperature=0)
    out = llm.generate(["Once upon a time"], params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) > 0 and len(out.text.split()) >= 3, out.text
