"""The layer loop in one compiled call (``mie._fast.forward``) against the model's own loop.

The oracle is the loop of ``Model.forward`` on the same compiled kernels (themselves checked
against the NumPy references in test_fast_linear.py and test_fast_ops.py): the plan calls the
same kernels in the same order on the same values, so the logits and every byte written to
the KV cache must be identical, not merely close -- for every architecture (Qwen2's bias,
Qwen3's per-head norms, Mistral's window), weight format (16-bit column panels included), KV
dtype, instruction set, and steps mixing decodes with chunks of several tokens (prompts,
speculative verification). Each example also checks that the plan really took the steps it
should, so the comparison cannot pass by both sides running the loop.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import LINEAR_ISAS, force_isa, require_fast
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mie.backend import select
from mie.memory import BlockPool
from mie.model import Model, ModelConfig, bytes_per_block, kv_view, prepare_inputs
from mie.scheduler import BatchEntry, Sequence

FORMATS = ("float32", "bfloat16", "float16", "int8", "int4")
KV_DTYPES = ("float32", "float16", "bfloat16")
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def kernels():
    require_fast()
    return select("fast").kernels


@pytest.fixture(params=LINEAR_ISAS)
def isa(request, kernels):
    """The matrix products' and the attention's variants forced together (the attention has
    no VNNI variants: the set each extends beside them, ``mie._fast.isa.NARROWER``)."""
    from mie._fast import linear, ops
    from mie._fast.isa import NARROWER

    linear_isa = request.param
    for _ in force_isa(ops, NARROWER.get(linear_isa, linear_isa)):
        yield from force_isa(linear, linear_isa)


def traced(kernels):
    """``kernels`` whose decode plans record what each call returned (True: it took the
    step)."""
    from mie._fast import forward

    took: list[bool] = []

    def plan(layers, config):
        built = forward.layer_plan(layers, config)
        assert built is not None, "the plan refused weights the kernels read as they lie"

        def run(*args):
            took.append(built(*args))
            return took[-1]

        return run

    return dataclasses.replace(kernels, layer_plan=plan), took


def config_of(architecture: str, intermediate: int) -> ModelConfig:
    return ModelConfig(
        architecture=architecture,
        vocab_size=40,
        hidden_size=32,
        intermediate_size=intermediate,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        sliding_window=6 if architecture == "mistral" else None,
    )


def run_steps(model, sizes, kv_dtype, seed):
    """``len(sizes)`` forward passes of ``len(sizes[0])`` sequences, sequence ``i``
    computing its next ``sizes[step][i]`` tokens (random ids) in step ``step``: a decode when
    1, else a chunk (its first step: a prompt; later: proposed tokens to verify). The logits
    of every step and the cache's bytes at the end."""
    config, rng = model.config, np.random.default_rng(seed)
    longest = max(sum(column) for column in zip(*sizes, strict=True))
    blocks = len(sizes[0]) * -(-longest // BLOCK_SIZE)
    pool = BlockPool(blocks, bytes_per_block(config, BLOCK_SIZE, kv_dtype))
    kv = kv_view(pool, config, BLOCK_SIZE, kv_dtype)
    seqs = [Sequence(i, [], 1, (), pool.new_table(BLOCK_SIZE)) for i in range(len(sizes[0]))]
    logits = []
    for step in sizes:
        entries = []
        for seq, n in zip(seqs, step, strict=True):
            start = len(seq.token_ids)
            seq.token_ids.extend(rng.integers(config.vocab_size, size=n).tolist())
            seq.table.append_tokens(n)
            entries.append(BatchEntry(seq, start, n, is_prefill=n > 1))
        logits.append(model.forward(prepare_inputs(entries), kv))
    return logits, pool.arena.copy()


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    architecture=st.sampled_from(ARCHITECTURES),
    fmt=st.sampled_from(FORMATS),
    kv_dtype=st.sampled_from(KV_DTYPES),
    panels=st.booleans(),
    num_seqs=st.integers(1, 5),
    data=st.data(),
    seed=st.integers(0, 2**16),
)
def test_one_call_is_bit_for_bit_the_loop(
    kernels, isa, architecture, fmt, kv_dtype, panels, num_seqs, data, seed
):
    # 2,592 inputs puts a 16-bit down projection in two column panels (PANEL_INPUTS 2,560)
    config = config_of(architecture, 2592 if panels else 48)
    dtype, quantization = (
        (fmt, None)
        if fmt in ("float32", "bfloat16", "float16")
        else (
            "float32",
            fmt,
        )
    )
    # mostly decodes, some chunks: the first step's prompts, then verifications of 2-5
    size = st.one_of(st.just(1), st.integers(1, 5))
    sizes = data.draw(
        st.lists(st.lists(size, min_size=num_seqs, max_size=num_seqs), min_size=1, max_size=4)
    )
    fused_kernels, took = traced(kernels)
    loop_kernels = dataclasses.replace(kernels, layer_plan=None)
    fused = Model.random(config, seed, fused_kernels, dtype=dtype, quantization=quantization)
    loop = Model(config, fused.weights, loop_kernels)
    want_logits, want_cache = run_steps(loop, sizes, kv_dtype, seed)
    got_logits, got_cache = run_steps(fused, sizes, kv_dtype, seed)

    from mie._fast import linear

    formats = set()
    for layer in fused.weights.layers:
        downs = getattr(layer.down, "parts", [layer.down])
        formats.update(m.format for m in (layer.qkv, layer.o, layer.gate_up, *downs))
    thresholds = [linear.blas_min_rows(fmt) for fmt in formats]
    threshold = min((t for t in thresholds if t is not None), default=None)
    assert took == [threshold is None or sum(step) < threshold for step in sizes]
    for got, want in zip(got_logits, want_logits, strict=True):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got_cache, want_cache)


def small_model(kernels):
    config = config_of("qwen2", 48)
    return Model.random(config, 3, kernels, dtype="float32")


def one_decode(model, context=5):
    """A sequence of ``context`` tokens cached (zeros), and the inputs of its next token."""
    pool = BlockPool(4, bytes_per_block(model.config, BLOCK_SIZE, "float32"))
    seq = Sequence(0, list(range(context)), 1, (), pool.new_table(BLOCK_SIZE))
    seq.table.append_tokens(context)
    inputs = prepare_inputs([BatchEntry(seq, context - 1, 1, is_prefill=False)])
    return inputs, kv_view(pool, model.config, BLOCK_SIZE)


def test_rows_matmul_hands_to_blas_run_the_loop(kernels):
    """On the generic variant two rows go to BLAS (``BLAS_MIN_ROWS``): the loop takes them."""
    from mie._fast import linear, ops

    fused_kernels, took = traced(kernels)
    model = small_model(fused_kernels)
    for _ in force_isa(ops, "generic"):
        for _ in force_isa(linear, "generic"):
            run_steps(model, [[1], [2]], "float32", 0)
            run_steps(model, [[1, 1]], "float32", 0)
    assert took == [True, False, False]


def test_arguments_the_kernels_refuse_leave_the_error_to_the_loop(kernels):
    """A context longer than the sequence's block table: the plan writes nothing and the loop's
    attention says what is wrong, exactly as without the plan."""
    fused_kernels, took = traced(kernels)
    fused = small_model(fused_kernels)
    loop = Model(fused.config, fused.weights, dataclasses.replace(kernels, layer_plan=None))
    errors = []
    for model in (loop, fused):
        inputs, kv = one_decode(model)
        bad = dataclasses.replace(inputs, decode_context_lens=np.array([99], dtype=np.int64))
        with pytest.raises(ValueError) as caught:
            model.forward(bad, kv)
        errors.append(str(caught.value))
    assert took == [False]
    assert errors[0] == errors[1]


def test_weights_the_kernels_would_convert_are_not_planned(kernels):
    """A weight in Fortran order is converted by every product of the loop; the plan refuses it
    (None) and the loop computes as before."""
    from mie._fast import forward

    model = small_model(kernels)
    layer = model.weights.layers[1]
    layer.o = dataclasses.replace(layer.o, weight=np.asfortranarray(layer.o.weight))
    assert forward.layer_plan(model.weights.layers, model.config) is None
    inputs, kv = one_decode(model)
    want = Model(model.config, model.weights, dataclasses.replace(kernels, layer_plan=None))
    np.testing.assert_array_equal(model.forward(inputs, kv), want.forward(inputs, kv))
