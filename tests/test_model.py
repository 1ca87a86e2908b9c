"""The model outside the transformers comparison: KV layout, random weights, bad chunks."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from model_runner import run_forward

from mie import ops
from mie.backend import PYTHON
from mie.memory import BlockPool, BlockTable
from mie.model import Model, ModelConfig, bytes_per_block, kv_view, random_weights

CONFIG = ModelConfig(
    architecture="qwen2",
    vocab_size=50,
    hidden_size=32,
    intermediate_size=48,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    max_position_embeddings=64,
)


def kv_pool(config, block_size, num_blocks):
    return BlockPool(num_blocks, bytes_per_block(config, block_size))


@pytest.fixture(scope="module")
def model():
    return Model.random(CONFIG, seed=1, kernels=PYTHON.kernels)


# -- KV layout ---------------------------------------------------------------------------------


def test_bytes_per_block_is_every_layers_k_and_v_in_float32():
    assert bytes_per_block(CONFIG, 16) == 3 * 2 * 16 * 2 * 8 * 4
    with pytest.raises(ValueError, match="block_size"):
        bytes_per_block(CONFIG, 0)


def test_kv_view_is_the_arena_without_a_copy():
    pool = kv_pool(CONFIG, block_size=4, num_blocks=5)
    kv = kv_view(pool, CONFIG, 4)
    assert kv.shape == (5, 3, 2, 4, 2, 8) and kv.dtype == np.float32
    block = pool.allocate()
    kv[block, 2, 1, 3, 1, 7] = 1.5  # last layer, V, last offset, last head, last dim
    raw = pool.block_data(block).view(np.float32)
    assert raw[-1] == 1.5 and np.count_nonzero(raw) == 1
    assert np.shares_memory(kv, pool.arena)


def test_kv_view_rejects_a_pool_of_another_shape():
    pool = kv_pool(CONFIG, block_size=4, num_blocks=2)
    with pytest.raises(ValueError, match="needs"):
        kv_view(pool, CONFIG, 8)


# -- random weights -----------------------------------------------------------------------------


def test_random_model_is_reproducible_per_seed(model):
    again = Model.random(CONFIG, seed=1)
    other = Model.random(CONFIG, seed=2)
    qkv = model.weights.layers[2].qkv.weight
    assert np.array_equal(qkv, again.weights.layers[2].qkv.weight)
    assert not np.array_equal(qkv, other.weights.layers[2].qkv.weight)
    assert model.weights.layers[0].qkv.weight.shape == (4 * 8 + 2 * 2 * 8, 32)  # (out, in)
    assert model.weights.layers[0].qkv.weight.flags.c_contiguous
    assert model.weights.layers[0].qkv_bias is not None  # qwen2
    for linear in (model.weights.embed, model.weights.lm_head, model.weights.layers[1].down):
        assert linear.weight.dtype == np.float32 and linear.scales is None


def test_tied_random_model_shares_one_embedding_array():
    tied = Model.random(ModelConfig(**{**CONFIG.__dict__, "tie_word_embeddings": True}))
    assert tied.weights.lm_head is tied.weights.embed


def test_forward_writes_kv_only_into_the_sequences_slots(model):
    pool = kv_pool(CONFIG, block_size=4, num_blocks=6)
    kv = kv_view(pool, CONFIG, 4)
    table = BlockTable(pool, 4)
    table.append_tokens(6)
    logits = run_forward(model, [(list(range(6)), 0, 6, table)])
    assert logits.shape == (1, 50) and logits.dtype == np.float32
    written = np.flatnonzero(np.abs(kv).sum(axis=(1, 2, 4, 5)).reshape(-1))  # slots
    blocks = table.blocks
    assert written.tolist() == [blocks[p // 4] * 4 + p % 4 for p in range(6)]


# -- chunks that cannot be computed leave everything untouched ----------------------------------


@pytest.mark.parametrize(
    ("chunk", "error", "message"),
    [
        (lambda t: ([1, 2, 3], 0, 4, t), ValueError, "has 3"),
        (lambda t: ([1, 2, 3, 4, 5, 6], 0, 6, t), ValueError, "block table holds 5"),
        (lambda t: ([1, 2, 50], 0, 3, t), ValueError, r"token ids must be ints in \[0, 50\)"),
        (lambda t: ([1.0, 2.0], 0, 2, t), ValueError, "token ids must be ints"),
        (lambda t: ([1, 2], -1, 2, t), ValueError, "start -1"),
        (lambda t: ([1, 2], 0, 0, t), ValueError, "num_tokens 0"),
        (lambda t: ([1, 2], 0.0, 2, t), TypeError, "integer"),
        (lambda t: ([1, 2], 0, 2, "table"), TypeError, "BlockTable"),
    ],
)
def test_bad_chunks_raise_before_writing(model, chunk, error, message):
    pool = kv_pool(CONFIG, block_size=4, num_blocks=4)
    table = BlockTable(pool, 4)
    table.append_tokens(5)
    before = pool.arena.copy()
    with pytest.raises(error, match=message):
        run_forward(model, [chunk(table)])
    assert np.array_equal(pool.arena, before) and table.num_tokens == 5


def test_positions_beyond_max_position_embeddings_are_refused(model):
    pool = kv_pool(CONFIG, block_size=16, num_blocks=5)
    with BlockTable(pool, 16) as table:
        table.append_tokens(65)
        with pytest.raises(ValueError, match="max_position_embeddings 64"):
            run_forward(model, [([0] * 65, 0, 65, table)])


@settings(max_examples=40, deadline=None)
@given(
    head_dim=st.sampled_from([8, 64]),
    scaling=st.sampled_from(
        [
            None,
            ops.RopeScaling("linear", factor=4.0),
            ops.RopeScaling(
                "yarn", factor=4.0, original_max_position_embeddings=1000, attention_factor=1.1
            ),
        ]
    ),
    steps=st.lists(st.lists(st.integers(0, 3999), min_size=1, max_size=6), min_size=1, max_size=6),
)
def test_rope_rows_are_the_angles_computed_for_the_positions_alone(head_dim, scaling, steps):
    """The model looks a step's rotary angles up in a table of every position so far; each
    lookup gives exactly ``ops.rope_cos_sin``'s bits for those positions, whichever steps
    grew the table, and the table never outgrows ``max_position_embeddings``."""
    config = dataclasses.replace(
        CONFIG, head_dim=head_dim, max_position_embeddings=4000, rope_scaling=scaling
    )
    model = Model(config, random_weights(config, 0), PYTHON.kernels)
    for step in steps:
        positions = np.array(step)
        cos, sin = model._rope(positions)
        expected = ops.rope_cos_sin(positions, head_dim, config.rope_theta, scaling)
        assert cos.tobytes() == expected[0].tobytes() and sin.tobytes() == expected[1].tobytes()
        assert len(model._rope_table[0]) <= config.max_position_embeddings


def test_chunks_from_different_pools_are_refused(model):
    a = BlockTable(kv_pool(CONFIG, 4, 2), 4)
    b = BlockTable(kv_pool(CONFIG, 4, 2), 4)
    a.append_tokens(1)
    b.append_tokens(1)
    with pytest.raises(ValueError, match="one pool"):
        run_forward(model, [([1], 0, 1, a), ([1], 0, 1, b)])
    with pytest.raises(ValueError, match="at least one entry"):
        run_forward(model, [])


def test_a_shared_block_without_a_free_block_to_split_into_is_an_error(model):
    pool = kv_pool(CONFIG, block_size=4, num_blocks=2)
    source, borrower = BlockTable(pool, 4), BlockTable(pool, 4)
    source.append_tokens(2)
    run_forward(model, [([1, 2], 0, 2, source)])
    borrower.borrow_prefix(source, 2)
    borrower.append_tokens(6)  # takes the last free block
    with pytest.raises(RuntimeError, match="copy-on-write"):
        run_forward(model, [([1, 2, 3, 4, 5, 6], 2, 4, borrower)])
