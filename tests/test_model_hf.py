"""mie's forward pass against Hugging Face transformers, the outside oracle.

Tiny random-weight models are built with transformers' own Llama / Mistral / Qwen2 / Qwen3
classes, their weights redrawn so every norm, bias and projection matters and logits are of
order one, and saved with ``save_pretrained`` (float32 and bfloat16; GQA ratios 1 to 7;
head_dim 8 to 64, for Qwen3 not hidden / heads; 1-4 layers; tied and untied embeddings;
RoPE unscaled and scaled by the llama3, yarn, linear and dynamic rules). mie loads the saved
directory; transformers computes the reference in float32 from the same files.
"""

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import require_module, run_to_completion
from hypothesis import given, settings
from hypothesis import strategies as st
from model_runner import run_forward
from tokenizers import Tokenizer

from mie import linear
from mie.backend import PYTHON, select
from mie.engine.chat import ChatTemplate
from mie.engine.llm_engine import LLMEngine
from mie.engine.sampling import SamplingParams
from mie.engine.tokenizer import Tokenizer as MieTokenizer
from mie.extension import fast_available
from mie.memory import BlockTable
from mie.model import Model, ModelConfig, bytes_per_block

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
# The trained tiny Llama the repository ships.
STORIES = Path(__file__).resolve().parents[1] / "models" / "stories260K"

LLAMA3_ROPE = {  # Llama 3.2's rule, its original context shrunk so that the tests pass it
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
    "rope_theta": 10000.0,
}
LLAMA32_ROPE = {
    **LLAMA3_ROPE,
    "factor": 32.0,
    "rope_theta": 5e5,
    "original_max_position_embeddings": 8,
}

SPECS = {
    # name: (architecture, saved dtype, heads, kv heads, head_dim, hidden, layers, tied[,
    #        other config arguments])
    "qwen2-gqa1-hd16-untied-fp32": ("qwen2", torch.float32, 4, 4, 16, 64, 2, False),
    "qwen2-gqa7-hd64-tied-fp32": ("qwen2", torch.float32, 7, 1, 64, 112, 1, True),
    "llama-gqa2-hd16-tied-fp32": ("llama", torch.float32, 4, 2, 16, 64, 3, True),
    "llama-gqa7-hd16-untied-bf16": ("llama", torch.bfloat16, 14, 2, 16, 112, 4, False),
    "qwen2-gqa2-hd64-tied-bf16": ("qwen2", torch.bfloat16, 4, 2, 64, 128, 2, True),
    # Qwen3: head_dim is not hidden / heads (32 vs 16, 16 vs 6), q_norm and k_norm.
    "qwen3-gqa2-hd32-untied-fp32": ("qwen3", torch.float32, 4, 2, 32, 64, 2, False),
    "qwen3-gqa4-hd16-tied-bf16": ("qwen3", torch.bfloat16, 8, 2, 16, 48, 2, True),
    # Llama 3.x RoPE: every prompt and generation runs past the original context.
    "llama3rope-gqa2-hd16-untied-fp32": (
        "llama",
        torch.float32,
        4,
        2,
        16,
        64,
        2,
        False,
        {"rope_parameters": LLAMA3_ROPE},
    ),
    "llama3rope-gqa4-hd64-tied-bf16": (
        "llama",
        torch.bfloat16,
        4,
        1,
        64,
        64,
        1,
        True,
        {"rope_parameters": LLAMA32_ROPE},
    ),
    "llama-linear-rope-gqa1-hd16-fp32": (
        "llama",
        torch.float32,
        4,
        4,
        16,
        64,
        1,
        True,
        {"rope_parameters": {"rope_type": "linear", "factor": 2.5, "rope_theta": 100.0}},
    ),
    # Qwen2.5's long-context yarn (attention scaled by 0.1 ln 4 + 1), original context shrunk.
    "qwen2-yarn-gqa2-hd16-untied-fp32": (
        "qwen2",
        torch.float32,
        4,
        2,
        16,
        64,
        2,
        False,
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "rope_theta": 1e4,
                "original_max_position_embeddings": 16,
            }
        },
    ),
    # Dynamic NTK is the unscaled table below max_position_embeddings, the most mie runs.
    "llama-dynamic-rope-gqa2-hd16-fp32": (
        "llama",
        torch.float32,
        4,
        2,
        16,
        64,
        1,
        False,
        {
            "rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 100.0},
            "max_position_embeddings": 64,
        },
    ),
    # Mistral: full attention (no window, or one covering every position).
    "mistral-gqa4-hd16-untied-fp32": (
        "mistral",
        torch.float32,
        8,
        2,
        16,
        64,
        2,
        False,
        {"sliding_window": None},
    ),
    "mistral-gqa2-hd32-untied-bf16": (
        "mistral",
        torch.bfloat16,
        4,
        2,
        32,
        96,
        2,
        False,
        {"sliding_window": 256},
    ),
    # Mistral with sliding windows shorter than every long prompt and generation here, one a
    # multiple of no block size the tests use (7), one of some (12: blocks of 4, not 5 or 8).
    "mistral-window7-gqa4-hd16-untied-fp32": (
        "mistral",
        torch.float32,
        8,
        2,
        16,
        64,
        2,
        False,
        {"sliding_window": 7},
    ),
    "mistral-window12-gqa2-hd32-tied-bf16": (
        "mistral",
        torch.bfloat16,
        4,
        2,
        32,
        64,
        3,
        True,
        {"sliding_window": 12},
    ),
    # SmolLM2 is plain Llama: 9 heads over 3 KV heads, tied, rope_theta 1e5.
    "smollm2-gqa3-hd8-tied-bf16": (
        "llama",
        torch.bfloat16,
        9,
        3,
        8,
        72,
        2,
        True,
        {"rope_theta": 1e5},
    ),
}
VOCAB = 320


def build_hf_model(spec, seed, vocab=VOCAB):
    arch, _, heads, kv_heads, head_dim, hidden, layers, tied, *other = spec
    config_class, model_class = {
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[arch]
    arguments = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=3 * hidden // 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=1e-5 if arch in ("llama", "mistral") else 1e-6,
        rope_theta=10000.0 if arch in ("llama", "mistral") else 1e6,
        tie_word_embeddings=tied,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    arguments.update(*other)
    torch.manual_seed(seed)
    model = model_class(config_class(**arguments)).eval()
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
    qkv = model.weights.layers[0].qkv.weight  # its bytes: 2 a weight in bfloat16
    weights = linear.output_size(qkv) * linear.input_size(qkv)
    assert qkv.nbytes == {"float32": 4, "bfloat16": 2}[expected] * weights


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
def test_a_prompt_computed_in_chunks_has_transformers_logits(pair, backend):
    """Chunked prefill's view of the model: one prompt computed chunk after chunk (sizes as a
    small budget leaves them, ending mid-block), each chunk attending to the cached K/V of
    the ones before; every position's logits equal transformers' whole-prompt run."""
    model, hf = with_backend(pair[0], backend), pair[1]
    block_size = 5
    tokens = random_tokens(77, 41)
    expected = hf_logits(hf, tokens)
    pool = kv_pool(model.config, block_size, num_blocks=16, backend=select(backend))
    table = select(backend).BlockTable(pool, block_size)
    start, rows = 0, []
    for n in (3, 7, 1, 13, 17):
        table.append_tokens(n)
        rows.append(run_forward(model, [(tokens, start, n, table)], all_positions=True))
        start += n
    np.testing.assert_allclose(np.concatenate(rows), expected, rtol=0, atol=FP32_TOLERANCE)
    table.release()
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


# -- the families' checkpoint directories, end to end ---------------------------------------------


def test_transformers_4_rope_scaling_spelling_loads_the_same_model(tmp_path):
    """A Llama 3.2-style config.json as transformers 4 wrote it (``rope_scaling`` with
    ``rope_type``, ``rope_theta`` at the top level, no ``rope_parameters``) reads as the same
    scaled RoPE, and the model still matches transformers reading that file."""
    spec = SPECS["llama3rope-gqa2-hd16-untied-fp32"]
    build_hf_model(spec, seed=9).save_pretrained(tmp_path)
    written = ModelConfig.from_pretrained(tmp_path)
    path = tmp_path / "config.json"
    hf_config = json.loads(path.read_text())
    rope = hf_config.pop("rope_parameters")
    hf_config["rope_theta"] = rope.pop("rope_theta")
    hf_config["rope_scaling"] = rope
    path.write_text(json.dumps(hf_config))
    assert ModelConfig.from_pretrained(tmp_path) == written
    assert written.rope_scaling is not None and written.rope_scaling.rope_type == "llama3"

    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    model = Model.from_pretrained(tmp_path, PYTHON.kernels)
    tokens = random_tokens(4, 48)  # three times the original context of 16
    pool = kv_pool(model.config, 8, num_blocks=8)
    with BlockTable(pool, 8) as table:
        table.append_tokens(48)
        logits = run_forward(model, [(tokens, 0, 48, table)], all_positions=True)
    np.testing.assert_allclose(logits, hf_logits(hf, tokens), rtol=0, atol=FP32_TOLERANCE)


# Qwen3's chat format (its template without tools and thinking branches), stories260K's
# tokenizer: the special tokens are plain text to it, which is all the Jinja path needs.
QWEN3_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}"
    "{% endif %}"
)
CONVERSATIONS = [
    [
        {"role": "system", "content": "You tell short stories about a dog named Max."},
        {"role": "user", "content": question},
    ]
    for question in ("Where did Max go?", "What did Max eat?", "Who is Max's friend?", "Hi")
]


@pytest.fixture(scope="module")
def qwen3_chat(tmp_path_factory):
    """A Qwen3 checkpoint directory with a chat template and two stop tokens; transformers'
    model and tokenizer on it; the conversations' prompt ids as transformers renders them."""
    directory = tmp_path_factory.mktemp("qwen3-chat")
    hf = build_hf_model(SPECS["qwen3-gqa2-hd32-untied-fp32"], seed=11, vocab=512)
    hf.save_pretrained(directory)
    shutil.copy(STORIES / "tokenizer.json", directory)
    tokenizer_config = json.loads((STORIES / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = QWEN3_CHAT_TEMPLATE
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    prompts = [
        tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
        for c in CONVERSATIONS
    ]
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    # Stop tokens from transformers' own free continuation of the first conversation, so
    # at least one request ends on each list entry's account or runs to its length.
    with torch.no_grad():
        free = hf.generate(torch.tensor([ids[0]]), max_new_tokens=40, do_sample=False)
    free = free[0, len(ids[0]) :].tolist()
    eos = [free[12], free[30]]
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return directory, hf, prompts, ids, eos


@pytest.mark.parametrize("backend", BACKENDS)
def test_qwen3_checkpoint_chats_through_the_engine_like_transformers(qwen3_chat, backend):
    """The chat template renders and encodes as transformers' ``apply_chat_template`` does;
    the engine stops on generation_config.json's stop tokens; greedy tokens equal
    ``generate``'s, in one continuous batch that shares the system prompt's blocks and is
    preempted for lack of blocks."""
    directory, hf, prompts, ids, eos = qwen3_chat
    chat = ChatTemplate(directory, MieTokenizer(directory))
    assert [chat.apply(c) for c in CONVERSATIONS] == prompts
    assert [chat.encode(p) for p in prompts] == ids

    engine = LLMEngine(directory, backend=backend, block_size=4, num_blocks=40)
    config = engine.model.config
    assert config.architecture == "qwen3" and config.eos_token_ids == tuple(eos)
    params = SamplingParams(temperature=0, max_tokens=40)
    request_ids = [engine.add_request(prompt_ids, params) for prompt_ids in ids]
    done = {i: out.outputs[0] for i, out in run_to_completion(engine).items()}
    assert engine.stats.preemptions > 0 and engine.stats.prefix_hit_tokens > 0
    stopped = 0
    for prompt_ids, request_id in zip(ids, request_ids, strict=True):
        with torch.no_grad():
            expected = hf.generate(
                torch.tensor([prompt_ids]), max_new_tokens=40, do_sample=False, eos_token_id=eos
            )[0, len(prompt_ids) :].tolist()
        assert done[request_id].token_ids == expected
        stopped += done[request_id].finish_reason == "stop"
    assert stopped >= 1  # the first conversation, at least, ends on a stop token


# -- Mistral's sliding window as a memory mechanism, end to end -----------------------------------


@pytest.fixture(scope="module")
def mistral_window(tmp_path_factory):
    """A Mistral checkpoint with a sliding window of 7 (blocks of 4: not a multiple), and
    prompts that share a 9-token prefix, plus one unrelated."""
    directory = tmp_path_factory.mktemp("mistral-window")
    hf = build_hf_model(SPECS["mistral-window7-gqa4-hd16-untied-fp32"], seed=12, vocab=512)
    hf.save_pretrained(directory)
    shutil.copy(STORIES / "tokenizer.json", directory)
    shutil.copy(STORIES / "tokenizer_config.json", directory)
    system = random_tokens(40, 9)
    prompts = [system + random_tokens(41 + i, n) for i, n in enumerate((3, 8, 1))]
    prompts.append(random_tokens(50, 13))
    return directory, hf, prompts


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("backend", BACKENDS)
def test_mistral_window_engine_releases_blocks_and_matches_transformers(
    mistral_window, backend, prefix_caching
):
    """Greedy generations of 40 tokens (the window of 7 crossed five times) through the
    engine, four requests in one continuous batch over a pool too small for them all: equal
    to transformers' ``generate`` token for token, while blocks before each window go back
    to the pool (a sequence holds at most window_blocks(7, 4) = 3 blocks between steps),
    prefixes are shared or cached, and sequences are preempted and recomputed."""
    directory, hf, prompts = mistral_window
    engine = LLMEngine(
        directory,
        backend=backend,
        block_size=4,
        num_blocks=9,
        max_num_seqs=4,
        max_num_batched_tokens=8,
        prefix_caching=prefix_caching,
    )
    assert engine.model.config.sliding_window == 7
    assert engine.scheduler.sliding_window == 7
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    # The first prompt's first chunk (8 tokens: nothing released yet) is computed before the
    # others arrive, so they can borrow it from the running sequence or the cache.
    ids = [engine.add_request(prompts[0], params)]
    done, released = {}, 0
    engine.step()
    ids += [engine.add_request(p, params) for p in prompts[1:]]
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        for seq in engine.scheduler.running:
            released = max(released, seq.table.num_released)
            assert seq.table.num_blocks - seq.table.num_released <= 3
        engine.scheduler.check_integrity()
    assert released >= 10  # 52 tokens of blocks of 4, most of them released
    assert engine.stats.preemptions > 0 and engine.stats.prefix_hit_tokens > 0
    for prompt, request_id in zip(prompts, ids, strict=True):
        with torch.no_grad():
            expected = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=40,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
        assert done[request_id] == expected
    idle = engine.scheduler.prefix_cache.num_evictable if prefix_caching else 0
    assert engine.pool.num_free + idle == engine.pool.num_blocks
