"""The layer loop in one compiled call (``mie._fast.decode``) against the model's own loop.

The oracle is the loop of ``Model.forward`` on the same compiled kernels (themselves checked
against the NumPy references in test_fast_linear.py and test_fast_ops.py): the plan calls the
same kernels in the same order on the same values, so the logits and every byte written to
the KV cache must be identical, not merely close -- for every architecture (Qwen2's bias,
Qwen3's per-head norms, Mistral's window), weight format (16-bit column panels included), KV
dtype, batch size and instruction set. Each example also checks that the plan really took
the step, so the comparison cannot pass by both sides running the loop.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import ALL_ISAS, force_isa, require_fast
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


@pytest.fixture(params=("avx512vnni", *ALL_ISAS))
def isa(request, kernels):
    """The matrix products' and the attention's variants forced together (the attention has
    no VNNI variant: AVX-512 beside it)."""
    from mie._fast import linear, ops

    linear_isa = request.param
    for _ in force_isa(ops, "avx512" if linear_isa == "avx512vnni" else linear_isa):
        yield from force_isa(linear, linear_isa)


def traced(kernels):
    """``kernels`` whose decode plans record what each call returned (True: it took the
    step)."""
    from mie._fast import decode

    took: list[bool] = []

    def plan(layers, config):
        built = decode.decode_plan(layers, config)
        assert built is not None, "the plan refused weights the kernels read as they lie"

        def run(*args):
            took.append(built(*args))
            return took[-1]

        return run

    return dataclasses.replace(kernels, decode_plan=plan), took


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


def decode_steps(model, prompts, steps, kv_dtype, rng):
    """Prefill ``prompts`` (one forward pass), then decode ``steps`` steps of one random token
    each for all of them; the logits of every step and the cache's bytes at the end."""
    config = model.config
    longest = max(len(p) for p in prompts) + steps
    blocks = len(prompts) * -(-longest // BLOCK_SIZE)
    pool = BlockPool(blocks, bytes_per_block(config, BLOCK_SIZE, kv_dtype))
    kv = kv_view(pool, config, BLOCK_SIZE, kv_dtype)
    seqs = [Sequence(i, list(p), 1, (), pool.new_table(BLOCK_SIZE)) for i, p in enumerate(prompts)]
    entries = []
    for seq in seqs:
        seq.table.append_tokens(len(seq.token_ids))
        entries.append(BatchEntry(seq, 0, len(seq.token_ids), is_prefill=True))
    logits = [model.forward(prepare_inputs(entries), kv)]
    for _ in range(steps):
        entries = []
        for seq in seqs:
            seq.token_ids.append(int(rng.integers(config.vocab_size)))
            seq.table.append_tokens(1)
            entries.append(BatchEntry(seq, len(seq.token_ids) - 1, 1, is_prefill=False))
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
    lengths=st.lists(st.integers(1, 11), min_size=1, max_size=6),
    steps=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_one_call_is_bit_for_bit_the_loop(
    kernels, isa, architecture, fmt, kv_dtype, panels, lengths, steps, seed
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
    fused_kernels, took = traced(kernels)
    loop_kernels = dataclasses.replace(kernels, decode_plan=None)
    fused = Model.random(config, seed, fused_kernels, dtype=dtype, quantization=quantization)
    loop = Model(config, fused.weights, loop_kernels)
    prompts = [
        np.random.default_rng(seed + i).integers(config.vocab_size, size=n).tolist()
        for i, n in enumerate(lengths)
    ]
    want_logits, want_cache = decode_steps(loop, prompts, steps, kv_dtype, np.random.default_rng(1))
    got_logits, got_cache = decode_steps(fused, prompts, steps, kv_dtype, np.random.default_rng(1))

    from mie._fast import linear

    threshold = linear.BLAS_MIN_ROWS[linear.ISA]
    planned = threshold is None or len(prompts) < threshold
    # the first pass is a step of decodes too when every prompt is one token
    assert took == [planned] * (steps + (max(lengths) == 1))
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


def test_a_step_with_a_prefill_runs_the_loop(kernels):
    fused_kernels, took = traced(kernels)
    model = small_model(fused_kernels)
    decode_steps(model, [[1, 2, 3]], 0, "float32", np.random.default_rng(0))  # a prefill only
    assert took == []


def test_arguments_the_kernels_refuse_leave_the_error_to_the_loop(kernels):
    """A context longer than the sequence's block table: the plan writes nothing and the loop's
    attention says what is wrong, exactly as without the plan."""
    fused_kernels, took = traced(kernels)
    fused = small_model(fused_kernels)
    loop = Model(fused.config, fused.weights, dataclasses.replace(kernels, decode_plan=None))
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
    from mie._fast import decode

    model = small_model(kernels)
    layer = model.weights.layers[1]
    layer.o = dataclasses.replace(layer.o, weight=np.asfortranarray(layer.o.weight))
    assert decode.decode_plan(model.weights.layers, model.config) is None
    inputs, kv = one_decode(model)
    want = Model(model.config, model.weights, dataclasses.replace(kernels, decode_plan=None))
    np.testing.assert_array_equal(model.forward(inputs, kv), want.forward(inputs, kv))
