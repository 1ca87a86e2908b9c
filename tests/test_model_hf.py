"""mie's forward pass against Hugging Face transformers, the outside oracle.

Tiny random-weight models are built with transformers' own Qwen2 / Llama classes, their
weights redrawn so every norm, bias and projection matters and logits are of order one, and
saved with ``save_pretrained`` (float32 and bfloat16; GQA ratios 1, 2, 7; head_dim 16 and
64; 1-4 layers; tied and untied embeddings). mie loads the saved directory; transformers
computes the reference in float32 from the same files.
"""

import math
from pathlib import Path

import numpy as np
import pytest
from conftest import require_module
from hypothesis import given, settings
from hypothesis import strategies as st
from model_runner import run_forward
from tokenizers import Tokenizer

from mie.backend import PYTHON, select
from mie.extension import fast_available
from mie.memory import BlockTable
from mie.model import Model, bytes_per_block

torch = require_module("torch")
transformers = require_module("transformers")
AutoModelForCausalLM = transformers.AutoModelForCausalLM
LlamaConfig, LlamaForCausalLM = transformers.LlamaConfig, transformers.LlamaForCausalLM
Qwen2Config, Qwen2ForCausalLM = transformers.Qwen2Config, transformers.Qwen2ForCausalLM

torch.set_num_threads(1)

BACKENDS = [
    "python",
    pytest.param("fast", marks=pytest.mark.skipif(not fast_available(), reason="not built")),
]

FP32_TOLERANCE = 1e-4  # max |mie - transformers| over logits
# shared/ lies beside the repository, here and in CI.
STORIES = Path(__file__).resolve().parents[2] / "shared" / "models" / "stories260K"

SPECS = {
    # name: (architecture, saved dtype, heads, kv heads, head_dim, hidden, layers, tied)
    "qwen2-gqa1-hd16-untied-fp32": ("qwen2", torch.float32, 4, 4, 16, 64, 2, False),
    "qwen2-gqa7-hd64-tied-fp32": ("qwen2", torch.float32, 7, 1, 64, 112, 1, True),
    "llama-gqa2-hd16-tied-fp32": ("llama", torch.float32, 4, 2, 16, 64, 3, True),
    "llama-gqa7-hd16-untied-bf16": ("llama", torch.bfloat16, 14, 2, 16, 112, 4, False),
    "qwen2-gqa2-hd64-tied-bf16": ("qwen2", torch.bfloat16, 4, 2, 64, 128, 2, True),
}
VOCAB = 320


def build_hf_model(spec, seed):
    arch, _, heads, kv_heads, head_dim, hidden, layers, tied = spec
    config_class, model_class = {
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "llama": (LlamaConfig, LlamaForCausalLM),
    }[arch]
    config = config_class(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=3 * hidden // 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=1e-5 if arch == "llama" else 1e-6,
        rope_theta=10000.0 if arch == "llama" else 1e6,
        tie_word_embeddings=tied,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.3 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.3 * torch.randn_like(param))
            else:  # (out, in) matrices and the embedding: rows of norm about one
                param.copy_(torch.randn_like(param) / math.sqrt(param.shape[1]))
    return model


@pytest.fixture(scope="module", params=sorted(SPECS))
def pair(request, tmp_path_factory):
    """(mie model, float32 transformers model) loaded from the same saved directory."""
    spec = SPECS[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    build_hf_model(spec, seed=len(request.param)).to(spec[1]).save_pretrained(directory)
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    return Model.from_pretrained(directory, PYTHON.kernels), hf


def test_weights_are_stored_in_the_checkpoints_dtype_by_default(pair, request):
    """dtype="auto": the bfloat16 checkpoints are computed from bfloat16 weights (so the
    tests here hold bfloat16 storage to transformers' float32 within FP32_TOLERANCE)."""
    model, hf = pair
    saved = SPECS[request.node.callspec.params["pair"]][1]
    expected = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[saved]
    assert model.weights.format == expected
    assert model.weights.layers[0].qkv.weight.dtype.name == expected


def kv_pool(config, block_size, num_blocks, backend=PYTHON):
    return backend.BlockPool(num_blocks, bytes_per_block(config, block_size))


def with_backend(model, name):
    """The same weights, the KV kernels and block tables of backend ``name``."""
    return Model(model.config, model.weights, select(name).kernels)


def hf_logits(hf, token_ids):
    with torch.no_grad():
        return hf(torch.tensor([token_ids])).logits[0].numpy()


def random_tokens(seed, n):
    return np.random.default_rng(seed).integers(0, VOCAB, n).tolist()


# -- prompts alone --------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_prompt_logits_match_transformers(pair, block_size):
    """Every position of prompts of lengths 1 to 41, around and across block boundaries."""
    model, hf = pair
    tokens = random_tokens(block_size, 41)
    expected = hf_logits(hf, tokens)
    pool = kv_pool(model.config, block_size, num_blocks=64)
    for length in (1, 3, 5, 15, 16, 17, 41):
        with BlockTable(pool, block_size) as table:
            table.append_tokens(length)
            logits = run_forward(model, [(tokens, 0, length, table)], all_positions=True)
        assert logits.dtype == np.float32 and logits.shape == (length, VOCAB)
        np.testing.assert_allclose(logits, expected[:length], rtol=0, atol=FP32_TOLERANCE)
    assert pool.num_free == pool.num_blocks


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_continuations_equal_transformers_generate(pair, backend):
    """40 greedy tokens for three prompts decoded together, one joining mid-way."""
    model, hf = with_backend(pair[0], backend), pair[1]
    BlockTable = select(backend).BlockTable
    prompts = [random_tokens(100 + i, n) for i, n in enumerate((7, 1, 16))]
    new_tokens = 40
    expected = []
    for prompt in prompts:
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0
            )
        expected.append(out[0].tolist())

    pool = kv_pool(model.config, 8, num_blocks=32, backend=select(backend))
    sequences = [list(p) for p in prompts]
    tables = [BlockTable(pool, 8) for _ in prompts]
    computed = [0, 0, 0]  # tokens whose K/V are in the cache
    joins_at = [0, 0, 5]  # step at which each sequence is first scheduled
    for step in range(new_tokens + joins_at[-1]):
        active = [
            i
            for i in range(3)
            if step >= joins_at[i] and len(sequences[i]) < len(prompts[i]) + new_tokens
        ]
        chunks = []
        for i in active:
            n = len(sequences[i]) - computed[i]
            tables[i].append_tokens(n)
            chunks.append((sequences[i], computed[i], n, tables[i]))
        logits = run_forward(model, chunks)
        for row, i in enumerate(active):
            computed[i] = len(sequences[i])
            sequences[i].append(int(np.argmax(logits[row])))
    assert sequences == expected
    for table in tables:
        table.release()


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_batch_with_shared_prefixes_equals_each_prompt_alone(pair, backend):
    """Prefill, chunked prefill, decode and borrowed (copy-on-write) prefixes in one call."""
    model, hf = with_backend(pair[0], backend), pair[1]
    BlockTable = select(backend).BlockTable
    block_size = 4
    pool = kv_pool(model.config, block_size, num_blocks=40, backend=select(backend))
    base = random_tokens(7, 14)
    a = BlockTable(pool, block_size)
    a.append_tokens(13)
    run_forward(model, [(base, 0, 13, a)])  # A's prompt is cached; its token 13 is next
    a_blocks = a.blocks

    branch = base[:10] + random_tokens(8, 6)  # shares 10 tokens: a partly filled block
    extend = base[:12] + random_tokens(9, 4)  # shares 3 full blocks
    fresh = random_tokens(10, 9)
    single = random_tokens(11, 1)
    b, c, d, e = (BlockTable(pool, block_size) for _ in range(4))
    b.borrow_prefix(a, 10)
    c.borrow_prefix(a, 12)
    for table, n in ((a, 1), (b, 6), (c, 4), (d, 9), (e, 1)):
        table.append_tokens(n)
    b.writable_block(10)  # the scheduler's copy-on-write, before the model writes
    batch = [
        (base, 13, 1, a),  # decode
        (branch, 10, 6, b),  # prefill after a borrowed prefix, splits the shared block
        (extend, 12, 4, c),  # prefill after a borrowed prefix, no split needed
        (fresh, 0, 9, d),  # prefill from scratch
        (single, 0, 1, e),  # a one-token prompt, on the decode path
    ]
    mixed = run_forward(model, batch)

    assert b.blocks[2] != a_blocks[2], "the shared block must have been split"
    assert c.blocks[:3] == a_blocks[:3] and a.blocks[:4] == a_blocks
    sequences = (base, branch, extend, fresh, single)
    for row, tokens in enumerate(sequences):
        with BlockTable(pool, block_size) as alone_table:
            alone_table.append_tokens(len(tokens))
            alone = run_forward(model, [(tokens, 0, len(tokens), alone_table)])
        np.testing.assert_allclose(mixed[row], alone[0], rtol=0, atol=1e-5)
        np.testing.assert_allclose(mixed[row], hf_logits(hf, tokens)[-1], atol=FP32_TOLERANCE)
    for table in (a, b, c, d, e):
        table.release()
    assert pool.num_free == pool.num_blocks


# -- random schedules, one model ------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory):
    directory = tmp_path_factory.mktemp("schedules")
    build_hf_model(SPECS["llama-gqa2-hd16-tied-fp32"], seed=3).save_pretrained(directory)
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    sequences = [random_tokens(20 + i, 30) for i in range(3)]
    return (
        Model.from_pretrained(directory, PYTHON.kernels),
        sequences,
        [hf_logits(hf, s) for s in sequences],
    )


@settings(deadline=None, max_examples=15)
@given(
    block_size=st.sampled_from([1, 2, 3, 8, 16]),
    cuts=st.lists(st.lists(st.integers(1, 29), max_size=6), min_size=3, max_size=3),
)
def test_random_chunk_schedules_match_transformers(llama_pair, block_size, cuts):
    """Sequences split into random chunks, interleaved step by step: every row equals HF."""
    model, sequences, expected = llama_pair
    pool = kv_pool(model.config, block_size, num_blocks=3 * 30)
    plans = [sorted(set(c) | {0, 30}) for c in cuts]  # chunk boundaries per sequence
    tables = [BlockTable(pool, block_size) for _ in sequences]
    for step in range(max(map(len, plans)) - 1):
        chunks, owners = [], []
        for i, plan in enumerate(plans):
            if step + 1 < len(plan):
                start, end = plan[step], plan[step + 1]
                tables[i].append_tokens(end - start)
                chunks.append((sequences[i], start, end - start, tables[i]))
                owners.append((i, start, end))
        logits = run_forward(model, chunks, all_positions=True)
        row = 0
        for i, start, end in owners:
            np.testing.assert_allclose(
                logits[row : row + end - start], expected[i][start:end], atol=FP32_TOLERANCE
            )
            row += end - start
    for table in tables:
        table.release()


# -- checkpoints in other shapes ------------------------------------------------------------------


def test_sharded_checkpoint_gives_the_same_model(tmp_path):
    hf = build_hf_model(SPECS["qwen2-gqa1-hd16-untied-fp32"], seed=5)
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    model = Model.from_pretrained(tmp_path, PYTHON.kernels)
    tokens = random_tokens(1, 12)
    pool = kv_pool(model.config, 4, num_blocks=4)
    with BlockTable(pool, 4) as table:
        table.append_tokens(12)
        logits = run_forward(model, [(tokens, 0, 12, table)], all_positions=True)
    np.testing.assert_allclose(logits, hf_logits(hf, tokens), atol=FP32_TOLERANCE)


def test_bfloat16_checkpoint_against_transformers_computing_in_bfloat16(tmp_path):
    """mie widens bf16 weights and computes in float32; transformers stays in bfloat16.

    The two then differ by bf16 rounding of activations; the bound is loose on purpose and
    the argmax agrees wherever bf16 itself is not near a tie.
    """
    hf = build_hf_model(SPECS["qwen2-gqa2-hd64-tied-bf16"], seed=6).to(torch.bfloat16)
    hf.save_pretrained(tmp_path)
    model = Model.from_pretrained(tmp_path, PYTHON.kernels)
    tokens = random_tokens(2, 24)
    pool = kv_pool(model.config, 8, num_blocks=4)
    with BlockTable(pool, 8) as table:
        table.append_tokens(24)
        logits = run_forward(model, [(tokens, 0, 24, table)], all_positions=True)
    with torch.no_grad():
        reference = hf(torch.tensor([tokens])).logits[0].float().numpy()
    assert np.max(np.abs(logits - reference)) < 0.25


# -- the real tiny model --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stories():
    hf = AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32).eval()
    return Model.from_pretrained(STORIES, PYTHON.kernels), hf


def test_stories260k_logits_match_transformers(stories):
    model, hf = stories
    tokens = [1, *random_tokens(3, 60)]
    pool = kv_pool(model.config, 16, num_blocks=8)
    with BlockTable(pool, 16) as table:
        table.append_tokens(len(tokens))
        logits = run_forward(model, [(tokens, 0, len(tokens), table)], all_positions=True)
    np.testing.assert_allclose(logits, hf_logits(hf, tokens), rtol=0, atol=FP32_TOLERANCE)


def test_stories260k_greedy_story_equals_transformers(stories):
    """From BOS, 64 greedy tokens: the same ids as transformers, and the README's story."""
    model, hf = stories
    with torch.no_grad():
        expected = hf.generate(
            torch.tensor([[1]]), max_new_tokens=64, do_sample=False, eos_token_id=None
        )[0].tolist()
    pool = kv_pool(model.config, 16, num_blocks=8)
    tokens = [1]
    with BlockTable(pool, 16) as table:
        while len(tokens) < 65:
            table.append_tokens(1)
            logits = run_forward(model, [(tokens, len(tokens) - 1, 1, table)])
            tokens.append(int(np.argmax(logits[0])))
    assert tokens == expected
    text = Tokenizer.from_file(str(STORIES / "tokenizer.json")).decode(tokens)
    assert text.startswith("Once upon a time, there was a little girl named Lily.")
    assert model.config.eos_token_ids == (1, 2)  # from generation_config.json
