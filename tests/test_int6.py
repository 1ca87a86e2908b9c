"""int6 weights (mie.linear.quantize_int6): the embedding and LM head of int4 models.

int6 is mie's own format, so no library holds it byte for byte. Its rounding is
``linear.offset_codes``, Q4_0's rule at any width, which is checked against llama.cpp's at
two widths: at 4 bits through ``quantize_int4`` (tests/test_int4.py: Q4_0's bytes) and at 5
bits here against ``gguf.quants``' Q5_0, whose rule it is (``d = m / -16``, codes
``trunc(w / d + 16.5)``). At 6 bits the same code runs with ``h = 32``. The layout is
checked by hand (a pair of blocks whose every byte is worked out below) and by an
element-by-element decoder written apart from mie's (tests/test_linear.py), the kernels
against the reference on every instruction set (tests/test_fast_linear.py).
"""

import dataclasses

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from mie import linear
from mie.model import Model
from tests.test_int4 import KINDS, QWEN2_TINY, block_values

gguf_quants = pytest.importorskip("gguf.quants")
Q5_0 = pytest.importorskip("gguf").GGMLQuantizationType.Q5_0

BLOCK = linear.GROUP_SIZE


@st.composite
def matrices(draw, pairs: bool = False) -> np.ndarray:
    """(N, K) float32 of blocks of every kind of tests/test_int4.py (mixed within a row); K a
    multiple of 64 when ``pairs``."""
    n = draw(st.integers(1, 5))
    groups = 2 * draw(st.integers(1, 3)) if pairs else draw(st.integers(1, 5))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kinds = draw(st.lists(st.sampled_from(KINDS), min_size=n * groups, max_size=n * groups))
    return np.concatenate([block_values(kind, rng) for kind in kinds]).reshape(n, groups * BLOCK)


def q5_0_codes(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's Q5_0 rows ``(N, K / 32 * 22)`` -> the codes ``(N, K / 32, 32)`` and the
    float16 scales: per block the scale's 2 bytes, 4 bytes whose bit i is code i's fifth bit
    (little-endian), 16 bytes of low nibbles (input j low, input j + 16 high)."""
    n = blocks.shape[0]
    rows = blocks.reshape(n, -1, 22)
    scales = rows[:, :, :2].copy().view("<f2")[:, :, 0]
    fifth = np.unpackbits(rows[:, :, 2:6], axis=2, bitorder="little")
    nibbles = rows[:, :, 6:]
    low = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=2)
    return low | (fifth << 4), scales


@settings(max_examples=300)
@given(matrices())
def test_the_rounding_at_5_bits_is_llama_cpp_q5_0(w):
    codes, scales = linear.offset_codes(w, 5)
    theirs, their_scales = q5_0_codes(gguf_quants.quantize(w, Q5_0))
    np.testing.assert_array_equal(codes, theirs)
    np.testing.assert_array_equal(scales.view(np.uint16), their_scales.view(np.uint16))


def _rounding_at_the_half_step_line() -> np.ndarray:
    """A block whose exact ``w / d + 32.5`` is 31.9999995 while float32's sum is 32.0: the code
    is 32, half a step plus 1.5e-8 from ``w`` (llama.cpp's float32 arithmetic does the same)."""
    w = np.zeros((1, 2 * BLOCK), np.float32)
    w[0, :2] = [1.0, 0.01562502]
    return w


@settings(max_examples=200)
@given(matrices(pairs=True))
@example(_rounding_at_the_half_step_line())
def test_int6_stores_the_6_bit_codes_within_half_a_step(w):
    codes, scales = linear.quantize_int6(w)
    n, k = w.shape
    assert codes.dtype == linear.INT6_DTYPE and codes.shape == (n, k // 64)
    assert scales.dtype == np.float16 and scales.shape == (n, k // BLOCK)
    assert linear.weight_format(codes) == "int6" and linear.input_size(codes) == k
    six, six_scales = linear.offset_codes(w, 6)
    np.testing.assert_array_equal(linear.int6_codes(codes), six.reshape(n, k).astype(int) - 32)
    np.testing.assert_array_equal(scales, six_scales)
    # the float32 step d = m / -32 rounds w to within d / 2 (a whole d where the code
    # saturates at 63: -m, when the block holds it too); storing d as a half moves each value
    # by at most 32 times the scale's rounding. The codes come from float32 ``w * (1 / d) +
    # 32.5``, whose three roundings (the reciprocal, the product, the sum, each within half of
    # float32's spacing at up to 64, 2^-18) can carry a value across a half-step line by up
    # to 2^-17 of a step
    blocks = w.reshape(n, -1, BLOCK)
    d = np.abs(np.take_along_axis(blocks, np.abs(blocks).argmax(2)[:, :, None], 2)) / 32
    half = np.abs(d - np.abs(scales.astype(np.float32))[:, :, None])
    step = np.where(six == 63, d, d / 2)
    error = np.abs(linear.dequantize_int6(codes, scales).reshape(n, -1, BLOCK) - blocks)
    assert (error <= step + 32 * half + 1e-30 + 2.0**-17 * d).all()


def test_rounding_example():
    """A block whose largest magnitude is -32 has d = 1: codes are trunc(w + 32.5), so halves
    round up (towards +inf), -32 is code 0 and +32 saturates at code 63 (+31)."""
    w = np.zeros((1, 2 * BLOCK), np.float32)
    w[0, :8] = [-32.0, 0.5, 1.5, -0.5, -1.5, 31.5, 32.0, 2.25]
    codes, scales = linear.quantize_int6(w)
    assert scales[0, 0] == 1.0 and scales[0, 1] == 0
    values = linear.int6_codes(codes)[0]
    np.testing.assert_array_equal(values[:8], [-32, 1, 2, 0, -1, 31, 31, 2])
    np.testing.assert_array_equal(values[8:], 0)  # zeros: code 32


def test_the_layout_of_a_pair_by_hand():
    """d = 1 in both blocks (inputs 0 and 32 are -32: code 0); input 1 is 31 (code 63:
    nibble 15, top 3), input 16 is -16 (code 16: nibble 0, top 1), input 33 is 15 (code 47:
    nibble 15, top 2); every other input 0 (code 32: nibble 0, top 2)."""
    w = np.zeros((1, 64), np.float32)
    w[0, [0, 32, 1, 16, 33]] = [-32, -32, 31, -16, 15]
    raw = linear.quantize_int6(w)[0].view(np.uint8)[0]
    assert raw.shape == (48,)
    # nibbles: byte j of block b holds input 32b + j low and 32b + 16 + j high
    assert raw[0] == 0x00 and raw[1] == 0x0F and raw[16] == 0x00 and raw[17] == 0x0F
    assert (raw[2:16] == 0).all() and (raw[18:32] == 0).all()
    # top bits: byte 32 + p holds inputs p, 32 + p, 16 + p, 48 + p in bits 0-1, 2-3, 4-5, 6-7
    assert raw[32] == 0 | 0 << 2 | 1 << 4 | 2 << 6
    assert raw[33] == 3 | 2 << 2 | 2 << 4 | 2 << 6
    assert (raw[34:] == 2 | 2 << 2 | 2 << 4 | 2 << 6).all()


@pytest.mark.parametrize(
    "w, message",
    [
        (np.zeros((2, 32), np.float32), "K = 32 inputs per row is not a multiple of 64"),
        (np.zeros((2, 96), np.float32), "K = 96 inputs"),
        (np.zeros(64, np.float32), "2-D weight"),
        (np.full((1, 64), np.nan, np.float32), "NaN or infinite"),
        (np.full((1, 64), 2.1e6, np.float32), "scale overflows float16"),
    ],
)
def test_quantize_int6_refuses(w, message):
    with pytest.raises(ValueError, match=message):
        linear.quantize_int6(w)


def test_bad_int6_arguments_are_refused():
    x = np.ones((2, 128), np.float32)
    codes = np.zeros((3, 2), linear.INT6_DTYPE)
    scales = np.ones((3, 4), np.float16)
    with pytest.raises(ValueError, match="int6 weight needs its scales"):
        linear.matmul(x, codes, None)
    with pytest.raises(ValueError, match=r"must have shape \(3, 4\)"):
        linear.matmul(x, codes, np.ones((3, 2), np.float16))
    with pytest.raises(ValueError, match=r"\(N, K\) = \(3, 128\)"):
        linear.matmul(np.ones((2, 64), np.float32), codes, scales)
    assert linear.matmul(x, codes, scales).shape == (2, 3)


def test_an_int4_model_whose_rows_are_not_whole_pairs_keeps_an_int8_embedding():
    """hidden 96: whole blocks of 32 (the layers' q/k/v, gate/up int4) but not whole pairs of
    them, so the embedding / LM head stays int8; hidden 128 gets int6. Each in rows of 16
    interleaved where the vocabulary is whole groups of 16 (256: int8x16, int6x16), row by
    row where it is not (250). (The layers' q/k/v, whole groups of 16 rows, are int4x16.)"""
    for hidden, vocab, embedding in (
        (96, 256, "int8x16"),
        (128, 256, "int6x16"),
        (96, 250, "int8"),
        (128, 250, "int6"),
    ):
        config = dataclasses.replace(QWEN2_TINY, hidden_size=hidden, vocab_size=vocab)
        model = Model.random(config, seed=0, quantization="int4")
        assert model.weights.embed.format == embedding
        assert model.weights.layers[0].qkv.format == "int4x16"
