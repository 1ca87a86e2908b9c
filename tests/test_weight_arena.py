"""The weight arena (mie.model.weight_arena): placed arrays keep their values, do not overlap,
start aligned, and live in huge-page regions; the model builders keep every matrix there."""

from __future__ import annotations

import mmap
import re
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from conftest import STORIES
from hypothesis import given, settings
from hypothesis import strategies as st

from mie.checkpoint import Checkpoint
from mie.model import ModelConfig, weight_arena, weights
from mie.model.precision import resolve_dtype
from mie.model.weight_arena import ALIGNMENT, HUGE_PAGE, WeightArena, huge_page_region
from mie.model.weights import Linear, Panels, load_weights, random_weights

DTYPES = (np.uint8, np.int8, np.uint16, np.float32)


def thp_mode() -> str | None:
    """The system's transparent huge page mode (always / madvise / never), None without."""
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not path.exists():
        return None
    return re.search(r"\[(\w+)\]", path.read_text()).group(1)


def smaps_entry(address: int) -> dict[str, str]:
    """The fields of /proc/self/smaps for the mapping that holds ``address``."""
    entry, inside = {}, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        bounds = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if bounds:
            inside = int(bounds.group(1), 16) <= address < int(bounds.group(2), 16)
        elif inside and ":" in line:
            key, value = line.split(":", 1)
            entry[key] = value.strip()
    return entry


def test_a_region_starts_on_a_huge_page_and_is_advised_so():
    region = huge_page_region(3 * HUGE_PAGE + 100)
    assert len(region) == 3 * HUGE_PAGE + 100 and region.dtype == np.uint8
    assert region.ctypes.data % HUGE_PAGE == 0
    assert region.flags.writeable and not region.any()  # fresh memory reads as zeros
    region[-1] = 7
    mode = thp_mode()
    if mode in ("always", "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        # the kernel's own word that huge pages may back it: with "madvise" only after
        # MADV_HUGEPAGE, and never for a shared anonymous mapping
        assert smaps_entry(region.ctypes.data).get("THPeligible") == "1"


@st.composite
def arrays(draw) -> np.ndarray:
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 40), min_size=1, max_size=3)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    return rng.integers(0, 250, size=shape).astype(dtype)


@settings(max_examples=60, deadline=None)
@given(st.lists(arrays(), min_size=1, max_size=12), st.sampled_from([256, 4096, 1 << 20]))
def test_placed_arrays_keep_their_values_and_never_overlap(batch, region):
    with mock.patch.object(weight_arena, "REGION_BYTES", region):  # regions of a few arrays
        arena = WeightArena()
        placed = [arena.place(a) for a in batch]
    spans = []
    for original, copy in zip(batch, placed, strict=True):
        assert copy.dtype == original.dtype and copy.shape == original.shape
        assert copy.flags.c_contiguous
        np.testing.assert_array_equal(copy, original)
        assert not np.shares_memory(copy, original)
        assert copy.ctypes.data % ALIGNMENT == 0
        if copy.nbytes:
            spans.append((copy.ctypes.data, copy.ctypes.data + copy.nbytes))
    spans.sort()
    for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
        assert end <= start
    for original in batch:  # the copies are the arena's own
        original += 1
    for original, copy in zip(batch, placed, strict=True):
        np.testing.assert_array_equal(copy + np.ones((), copy.dtype), original)


def test_an_array_larger_than_a_region_gets_one_of_its_own(monkeypatch):
    monkeypatch.setattr(weight_arena, "REGION_BYTES", 4096)  # regions round up to a huge page
    arena = WeightArena()
    small = arena.place(np.arange(10, dtype=np.float32))
    assert small.ctypes.data % HUGE_PAGE == 0  # the first region's start
    values = np.arange(HUGE_PAGE + 1, dtype=np.uint64).astype(np.uint8)
    large = arena.place(values)
    assert large.ctypes.data % HUGE_PAGE == 0 and large.ctypes.data != small.ctypes.data
    np.testing.assert_array_equal(large, values)
    after = arena.place(np.arange(5, dtype=np.uint16))  # in the rest of the large one's region
    assert after.ctypes.data == large.ctypes.data + HUGE_PAGE + ALIGNMENT


def matrices(w) -> list[Linear]:
    """Every distinct matrix of ``w`` (panels as their parts)."""
    found = [w.embed, w.lm_head]
    for layer in w.layers:
        found += [layer.qkv, layer.o, layer.gate_up, layer.down]
    flat = []
    for m in found:
        flat += list(m.parts) if isinstance(m, Panels) else [m]
    return list({id(m): m for m in flat}.values())


def in_a_region(array: np.ndarray) -> bool:
    """Whether ``array`` is a view of an arena region (memory of an ``mmap``)."""
    while isinstance(array, np.ndarray) and array.base is not None:
        array = array.base
    return isinstance(array, memoryview) and isinstance(array.obj, mmap.mmap)


def assert_placed(w) -> None:
    for m in matrices(w):
        for array in (m.weight, m.scales):
            if array is not None:
                assert in_a_region(array) and array.ctypes.data % ALIGNMENT == 0


@pytest.mark.parametrize(
    "dtype, quantization", [("float32", None), ("bfloat16", None), ("float32", "int4")]
)
def test_random_weights_live_in_the_arena_with_the_values_they_had(
    monkeypatch, dtype, quantization
):
    config = ModelConfig.from_hf(
        {
            "model_type": "llama",
            "hidden_size": 64,
            "intermediate_size": 2600,  # a 16-bit down projection in panels
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 96,
            "tie_word_embeddings": True,
        }
    )
    w = random_weights(config, 3, dtype=dtype, quantization=quantization)
    assert_placed(w)
    assert w.lm_head is w.embed
    if dtype == "bfloat16":
        assert isinstance(w.layers[0].down, Panels)
    monkeypatch.setattr(weights, "placed", lambda arena, matrix: matrix)
    unplaced = random_weights(config, 3, dtype=dtype, quantization=quantization)
    assert not in_a_region(unplaced.layers[0].qkv.weight)
    for a, b in zip(matrices(w), matrices(unplaced), strict=True):
        np.testing.assert_array_equal(a.weight, b.weight)
        if a.scales is not None or b.scales is not None:
            np.testing.assert_array_equal(a.scales, b.scales)


def test_a_loaded_checkpoint_lives_in_the_arena():
    checkpoint = Checkpoint(STORIES)
    config = ModelConfig.from_pretrained(STORIES)
    w = load_weights(checkpoint, config, quantization="int8")
    assert_placed(w)
    # the same tensor as the checkpoint holds it, stored as the loader stores it, not placed
    name = "model.layers.0.self_attn.o_proj.weight"
    store = weights.storage(resolve_dtype("auto", config.dtype), "int8")
    expected = weights.in_row_groups(store(name, checkpoint.stored_tensor(name)))
    assert expected.format == "int8x16"
    np.testing.assert_array_equal(w.layers[0].o.weight, expected.weight)
    np.testing.assert_array_equal(w.layers[0].o.scales, expected.scales)
