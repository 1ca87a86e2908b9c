"""A model's weights in the layout and precision the forward pass wants, from a checkpoint or
at random.

Every matrix is a ``Linear``: the weight ``(out, in)`` exactly as PyTorch and safetensors
store ``nn.Linear.weight`` -- one output channel per row, which is the layout ``mie.linear``
multiplies fastest (each output streams one contiguous row: see there) -- in one of the
formats of ``mie.linear.WEIGHT_FORMATS``: float32, bfloat16, float16, int8 with a float16
scale per 32 inputs, or int4 (llama.cpp's Q4_0: packed 4-bit codes, ``(out, in / 2)``
bytes, with a float16 scale per 32 inputs). The one exception to a row per output: bfloat16,
int4, int8 and int6 matrices keep 16 rows interleaved block by block (bfloat16x16, int4x16,
int8x16 and int6x16, ``in_row_groups``), the same bytes in the order the kernels read
fastest. The format is chosen once, at load (``dtype`` and ``quantization``, see
``mie.model.precision``), tensor by tensor, so loading never holds a float32 copy of the
whole model. Norm weights and biases are tiny and stay float32.

Projections that read the same input are fused into one matrix -- q, k and v into ``qkv``,
gate and up into ``gate_up`` -- by stacking their rows, so a layer makes four matrix
products, not seven. One matrix may be split the other way: a float16 down projection with a
long input row is stored as column panels (``Panels``), so that at batch 1 each panel's
slice of the row stays in L1 beside the weight it meets.

The embedding is a ``Linear`` too, ``(vocab, hidden)`` in the same format as the layers
(int4 excepted, below): a row per token serves both the lookup (gather the rows, widen them)
and the LM head (``matmul(x, lm_head)``), so tied embeddings cost one array, not two. Why the
LM head is not kept wider than the rest: at Qwen2-0.5B's vocabulary of 151,936 it is 136M of
the model's 494M weights, the largest single share of the bytes batch-1 decoding reads per
token; keeping it in float32 would cost a quarter of the int8 speed-up. Its accuracy in each
format is measured with the rest (docs/precision.md). With int4 the embedding and LM head are
int6, a format of mie's own (``embedding_quantization``). Row-grouped like the layers when its
rows are whole groups of 16 (the LM head is then one more product of the fastest kernels),
the embedding's lookup takes each token's row back from its group (``Kernels.gather_rows``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, fields

import numpy as np

from mie import linear
from mie.checkpoint import Checkpoint, CheckpointError
from mie.model.config import ModelConfig
from mie.model.precision import NUMPY_DTYPES, check_quantization, resolve_dtype
from mie.model.weight_arena import WeightArena

logger = logging.getLogger(__name__)


@dataclass(eq=False)  # arrays: compare their values, not the objects
class Linear:
    """One weight matrix ``(out, in)`` in its stored format (int4: ``(out, in / 2)`` bytes of
    packed codes; int6: ``(out, in / 64)`` pairs of blocks); ``scales`` only for int8, int4
    and int6."""

    weight: np.ndarray
    scales: np.ndarray | None = None

    @property
    def format(self) -> str:
        return linear.weight_format(self.weight)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + (0 if self.scales is None else self.scales.nbytes)

    def rows(self, ids: np.ndarray, gather_rows: Callable) -> np.ndarray:
        """Rows ``ids`` as float32 ``(len(ids), in)`` by ``gather_rows`` (a
        ``Kernels.gather_rows``): the embedding lookup."""
        return gather_rows(self.weight, self.scales, ids).astype(np.float32, copy=False)

    def product(self, x: np.ndarray, matmul: Callable) -> np.ndarray:
        """``x @ matrix.T`` by ``matmul`` (a ``Kernels.matmul``)."""
        return matmul(x, self.weight, self.scales)


PANEL_INPUTS = 2560
"""The most inputs a 16-bit matrix keeps in one panel (``Panels``): a panel's slice of a
float32 input row is then at most 10 KB."""


@dataclass(eq=False)
class Panels:
    """A bfloat16 or float16 matrix of more than ``PANEL_INPUTS`` inputs, stored as column
    panels: each part holds the next of its inputs for every row, contiguous; the product is
    the sum of the parts' products, each over its slice of the input row.

    Why: at batch 1 each output reads its weight row once, beside the whole input row, which
    stays in L1 while it is small. The down projection's input is the intermediate row
    (Qwen2-0.5B: 4,864 floats, 19 KB): beside a weight row streaming through a 32 KB L1 it
    does not stay, and its reloads held that product to half or two thirds of the read rate of
    every other (bench/RESULTS.md, "The down product"). A panel's slice of the row stays, and
    each panel is still read as one sequential stream. int8 and int4 matrices multiply the
    input as int8 codes, a quarter of its bytes, and float32 ones read as many weight bytes
    as input bytes: measured, neither gained, so neither is split. A bfloat16x16 matrix
    (``in_row_groups``) reads each input once per 16 rows, not once per row: not split
    either."""

    parts: tuple[Linear, ...]

    scales = None  # 16-bit matrices have none

    @property
    def weight(self) -> np.ndarray:
        """The whole matrix ``(out, in)``, assembled (a copy), for the readers that export or
        compare it."""
        return np.concatenate([part.weight for part in self.parts], axis=1)

    @property
    def format(self) -> str:
        return self.parts[0].format

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)

    def product(self, x: np.ndarray, matmul: Callable) -> np.ndarray:
        """``x @ matrix.T``: each part's product over its slice of ``x``, summed. An ``x``
        that is not ``(M, in)`` gets the error the whole matrix's product gives (slices of a
        wider one would fit the panels and drop its last inputs unsaid)."""
        if np.ndim(x) != 2 or np.shape(x)[1] != sum(part.weight.shape[1] for part in self.parts):
            return matmul(x, self.weight)  # raises: the whole matrix's check, its message
        out, start = None, 0
        for part in self.parts:
            width = part.weight.shape[1]
            y = part.product(np.ascontiguousarray(x[:, start : start + width]), matmul)
            out = y if out is None else np.add(out, y, out=out)
            start += width
        return out


def placed(arena: WeightArena, matrix: Linear | Panels) -> Linear | Panels:
    """``matrix`` with its arrays copied into ``arena`` (``mie.model.weight_arena``: where the
    builders below keep every final matrix)."""
    if isinstance(matrix, Panels):
        return Panels(tuple(placed(arena, part) for part in matrix.parts))
    scales = None if matrix.scales is None else arena.place(matrix.scales)
    return Linear(arena.place(matrix.weight), scales)


def in_panels(matrix: Linear) -> Linear | Panels:
    """``matrix`` as ``Panels`` if it is a bfloat16 or float16 matrix of more than
    ``PANEL_INPUTS`` inputs (as few panels as that allows, of equal widths in whole blocks of
    32 inputs, the last one narrower), else ``matrix`` itself."""
    k = matrix.weight.shape[1]
    if matrix.format not in ("bfloat16", "float16") or k <= PANEL_INPUTS:
        return matrix
    count = -(-k // PANEL_INPUTS)
    width = -(-k // count // 32) * 32
    return Panels(
        tuple(
            Linear(np.ascontiguousarray(matrix.weight[:, a : a + width]))
            for a in range(0, k, width)
        )
    )


def in_row_groups(matrix: Linear) -> Linear:
    """``matrix`` in bfloat16x16, int4x16, int8x16 or int6x16 (``linear.group_rows``: the
    kernels' fastest layout) if it is a bfloat16, int4, int8 or int6 matrix of whole groups of
    16 rows and whole blocks of 32 inputs, else ``matrix`` itself. Every matrix, the
    embedding too: its lookups take each row's bytes back from its group (``Linear.rows``)."""
    rows = matrix.weight.shape[0]
    if matrix.format not in linear.GROUPED or rows % linear.GROUP_ROWS:
        return matrix
    if linear.input_size(matrix.weight) % linear.GROUP_SIZE:
        return matrix
    return Linear(*linear.group_rows(matrix.weight, matrix.scales))


@dataclass
class LayerWeights:
    """One decoder layer: matrices ``(out, in)`` in the model's format (bfloat16, int4 and int8
    ones of whole groups of 16 rows in bfloat16x16, int4x16 and int8x16: ``in_row_groups``),
    vectors float32."""

    input_norm: np.ndarray  # (hidden,)
    qkv: Linear  # (q_size + 2 * kv_size, hidden): q, then k, then v rows
    qkv_bias: np.ndarray | None  # (q_size + 2 * kv_size,), Qwen2 only
    o: Linear  # (hidden, q_size)
    post_norm: np.ndarray  # (hidden,)
    gate_up: Linear  # (2 * intermediate, hidden): gate, then up rows
    down: Linear | Panels  # (hidden, intermediate); Panels in float16 (and in bfloat16 not
    # row-grouped) when intermediate is long
    q_norm: np.ndarray | None = None  # (head_dim,), Qwen3 only: RMSNorm of each query head
    k_norm: np.ndarray | None = None  # (head_dim,), Qwen3 only: RMSNorm of each key head


@dataclass
class ModelWeights:
    """All of a model's weights."""

    embed: Linear  # (vocab, hidden)
    layers: list[LayerWeights]
    final_norm: np.ndarray  # (hidden,)
    lm_head: Linear  # (vocab, hidden); the very same object as ``embed`` when tied

    @property
    def format(self) -> str:
        """The matrices' format: float32, bfloat16, float16, int8 or int4 (the first layer's
        q/k/v projection's, row-grouped formats named as their rows; with int4 the embedding and
        LM head are int6, and a matrix whose input dimension is not a multiple of 32 is int8:
        see ``embedding_quantization`` and ``storage``)."""
        fmt = self.layers[0].qkv.format if self.layers else self.embed.format
        return linear.UNGROUPED.get(fmt, fmt)

    @property
    def nbytes(self) -> int:
        """Bytes of every weight as stored, int8 and int4 scales included (a tied LM head
        counted once)."""
        return sum(a.nbytes for a in self._arrays(with_scales=True))

    @property
    def num_parameters(self) -> int:
        """Distinct weight elements (a tied LM head counted once; scales are not
        parameters)."""
        return sum(
            a.size * linear.WEIGHTS_PER_ELEMENT.get(linear.weight_format(a), 1)
            for a in self._arrays(with_scales=False)
        )

    def _arrays(self, with_scales: bool) -> list[np.ndarray]:
        parts = [self.embed, self.lm_head, self.final_norm]
        for layer in self.layers:
            parts += [getattr(layer, field.name) for field in fields(layer)]
        arrays = []
        for part in parts:
            if isinstance(part, Panels):
                arrays += [panel.weight for panel in part.parts]
            elif isinstance(part, Linear):
                arrays.append(part.weight)
                if with_scales and part.scales is not None:
                    arrays.append(part.scales)
            elif part is not None:
                arrays.append(part)
        return list({id(a): a for a in arrays}.values())


EMBEDDING_ONLY = "int6"
"""A storage format for the embedding and LM head alone, never a ``quantization`` users
choose (``embedding_quantization``)."""


def embedding_quantization(quantization: str | None) -> str | None:
    """How the embedding and LM head are stored under ``quantization``: as the layers, except
    that int4 keeps them in int6 (``mie.linear``: Q4_0's rule with 6 bits, a format of mie's
    own). Why not int4: on stories260K an int4 embedding alone made int4's perplexity
    increase 1.31x llama.cpp q4_0's (whose quantizer gives the output matrix 6 or 8 bits),
    against 1.03x in int6 and 1.01x in int8 (docs/precision.md, "Perplexity"). Why not int8:
    at batch 1 the LM head is the largest single read (Qwen2-0.5B: 136M of 494M weights), and
    in int8 it held int4 to 1.52x int8's decoding speed by the bytes alone (330.2 against
    500.8 MiB); in int6 the model is 297.7 MiB. A matrix whose input dimension is not a
    multiple of 64 stays int8 (``storage``)."""
    return EMBEDDING_ONLY if quantization == "int4" else quantization


def storage(dtype: str, quantization: str | None) -> Callable[[str, np.ndarray], Linear]:
    """The function that stores one matrix, given its name (for errors) and values.

    The values (any float dtype) are first rounded to ``dtype`` -- exactly a no-op when they
    already are; float16 refuses values that would overflow to infinity, naming the tensor --
    then, for ``quantization="int8"``, ``"int4"`` or ``"int6"`` (``EMBEDDING_ONLY``),
    quantized from those values. int4 is whole blocks of 32 inputs
    (``linear.quantize_int4``) and int6 whole pairs of them: a matrix whose input dimension is
    not such a multiple is stored as int8, the same groups of 32 with a shorter last one and
    a finer step -- what llama.cpp cannot do (it refuses such a tensor for Q4_0), and a few
    bytes more than int4 for one matrix of a small model's layers (stories260K's down
    projection; every matrix of Qwen2, Llama and Mistral models is whole blocks).
    """
    if quantization != EMBEDDING_ONLY:
        check_quantization(quantization)
    target = NUMPY_DTYPES[dtype]

    def store(name: str, values: np.ndarray) -> Linear:
        try:
            if values.dtype != target:
                convert = linear.to_float16 if dtype == "float16" else lambda v: v.astype(target)
                values = convert(values)
            values = np.ascontiguousarray(values)
            if quantization == "int4" and values.shape[1] % linear.GROUP_SIZE == 0:
                return Linear(*linear.quantize_int4(values))
            if quantization == EMBEDDING_ONLY and values.shape[1] % linear.INT6_PAIR == 0:
                return Linear(*linear.quantize_int6(values))
            if quantization is not None:
                return Linear(*linear.quantize_int8(values))
        except ValueError as exc:  # float16 overflow; int8 / int4 / int6 of NaN or infinity
            raise ValueError(f"tensor {name!r}: {exc}") from None
        return Linear(values)

    return store


def load_weights(
    checkpoint: Checkpoint,
    config: ModelConfig,
    *,
    dtype: str = "auto",
    quantization: str | None = None,
    allow_non_finite_weights: bool = False,
) -> ModelWeights:
    """Read and convert every tensor the config calls for, one tensor at a time.

    ``dtype`` and ``quantization``: see ``mie.model.precision``; ``"auto"`` is the config's
    own ``dtype``. Shapes are checked against the config; a missing or misshapen tensor raises
    ``CheckpointError`` naming it. Tensors the model does not use are ignored.

    A tensor holding NaN or infinity also raises ``CheckpointError`` naming it, unless
    ``allow_non_finite_weights``: one such value poisons every output it reaches (a NaN in
    an embedding row, for instance, turns every logit of any prompt using that token into
    NaN), and a checkpoint carrying one is almost always corrupt. The check reads each tensor
    once more as it is converted, a few percent of the load time. (int8 cannot represent
    them at all, nor can int4, so with quantization they are refused regardless.)
    """
    require_finite = not allow_non_finite_weights
    resolved = resolve_dtype(dtype, config.dtype)
    store = storage(resolved, quantization)
    store_embedding = storage(resolved, embedding_quantization(quantization))

    def tensor(name: str, shape: tuple[int, ...]) -> np.ndarray:
        return checkpoint.stored_tensor(name, shape, require_finite=require_finite)

    def matrix(name: str, shape: tuple[int, int], store=store) -> Linear:
        try:
            return store(name, tensor(name, shape))
        except ValueError as exc:  # float16 overflow, or int8 / int4 of a non-finite value
            if isinstance(exc, CheckpointError):
                raise
            raise CheckpointError(f"{checkpoint.directory}: {exc}") from None

    def vector(name: str, size: int) -> np.ndarray:
        return tensor(name, (size,)).astype(np.float32)

    def stored_matrix(name: str, shape: tuple[int, int], embedding: bool) -> Linear:
        return matrix(name, shape, store_embedding if embedding else store)

    return assemble(config, stored_matrix, vector)


def assemble(
    config: ModelConfig,
    matrix: Callable[[str, tuple[int, int], bool], Linear],
    vector: Callable[[str, int], np.ndarray],
) -> ModelWeights:
    """The model's weights from a checkpoint's tensors, named as Hugging Face names them:
    ``matrix(name, (out, in), embedding)`` reads and stores one (``embedding``: the embedding
    or LM head), ``vector(name, size)`` reads a norm weight or bias as float32. Each source of
    tensors (safetensors here, GGUF in ``mie.model.gguf_weights``) supplies the two and gets
    the same layout."""
    hidden, inter = config.hidden_size, config.intermediate_size
    arena = WeightArena()

    def stacked(names: list[str], shapes: list[tuple[int, int]]) -> Linear:
        parts = [matrix(name, shape, False) for name, shape in zip(names, shapes, strict=True)]
        return placed(arena, in_row_groups(_stack(parts, names)))

    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        attn = p + "self_attn."
        qkv_names = [attn + f"{x}_proj" for x in "qkv"]
        qkv_sizes = [config.q_size, config.kv_size, config.kv_size]
        layers.append(
            LayerWeights(
                input_norm=vector(p + "input_layernorm.weight", hidden),
                qkv=stacked(
                    [name + ".weight" for name in qkv_names],
                    [(size, hidden) for size in qkv_sizes],
                ),
                qkv_bias=np.concatenate(
                    [
                        vector(name + ".bias", size)
                        for name, size in zip(qkv_names, qkv_sizes, strict=True)
                    ]
                )
                if config.qkv_bias
                else None,
                o=placed(
                    arena,
                    in_row_groups(matrix(attn + "o_proj.weight", (hidden, config.q_size), False)),
                ),
                post_norm=vector(p + "post_attention_layernorm.weight", hidden),
                gate_up=stacked(
                    [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
                    [(inter, hidden), (inter, hidden)],
                ),
                down=placed(
                    arena,
                    in_panels(
                        in_row_groups(matrix(p + "mlp.down_proj.weight", (hidden, inter), False))
                    ),
                ),
                q_norm=vector(attn + "q_norm.weight", config.head_dim) if config.qk_norm else None,
                k_norm=vector(attn + "k_norm.weight", config.head_dim) if config.qk_norm else None,
            )
        )
    vocab = (config.vocab_size, hidden)
    embed = placed(arena, in_row_groups(matrix("model.embed_tokens.weight", vocab, True)))
    lm_head = (
        embed
        if config.tie_word_embeddings
        else placed(arena, in_row_groups(matrix("lm_head.weight", vocab, True)))
    )
    final_norm = vector("model.norm.weight", hidden)
    return ModelWeights(embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head)


def _stack(parts: list[Linear], names: list[str]) -> Linear:
    """Fuse matrices that read the same input (``names``): their rows (and scales) one after
    another.

    A fused matrix has one format. Parts of one checkpoint share theirs, except in GGUF
    files, whose quantizer may give one projection more bits (llama.cpp's Q4_K_M stores some
    layers' v projection as Q6_K beside Q4_K q and k): int4 parts beside int8 ones are then
    requantized to int8, the finer of the two. Any other mix (a file quantized with
    per-tensor overrides: an F16 v beside F32 or Q8_0 q and k) is widened to float32, which
    holds every format's values exactly, with a warning: that matrix takes more memory."""
    formats = {part.format for part in parts}
    if formats == {"int4", "int8"}:
        parts = [
            Linear(*linear.quantize_int8(linear.widen(part.weight, part.scales)))
            if part.format == "int4"
            else part
            for part in parts
        ]
    elif len(formats) > 1:
        logger.warning(
            "%s are stored as %s: fused into one matrix, they are widened to float32",
            ", ".join(names),
            ", ".join(part.format for part in parts),
        )
        parts = [Linear(linear.widen(part.weight, part.scales)) for part in parts]
    weight = np.concatenate([part.weight for part in parts])
    if parts[0].scales is None:
        return Linear(weight)
    return Linear(weight, np.concatenate([part.scales for part in parts]))


def random_weights(
    config: ModelConfig,
    seed: int = 0,
    scale: float = 0.02,
    *,
    dtype: str = "float32",
    quantization: str | None = None,
) -> ModelWeights:
    """Random matrices and biases of standard deviation ``scale``, unit norm weights.

    For benchmarks and tests that need a model of a given shape without any file; the same
    seed gives the same float32 values, which are then stored as ``dtype`` and
    ``quantization`` would store a checkpoint holding them (``storage``), one matrix at a
    time. Values are uniform rather than normal because NumPy draws uniform float32 about six
    times faster: a Qwen2-0.5B-shaped model (about 2 GB of float32) takes a couple of seconds.
    """
    rng = np.random.default_rng(seed)
    half_width = np.float32(scale * np.sqrt(3.0))  # uniform(-a, a) has std a / sqrt(3)
    store = storage(resolve_dtype(dtype, "float32"), quantization)
    store_embedding = storage(resolve_dtype(dtype, "float32"), embedding_quantization(quantization))

    def uniform(*shape: int) -> np.ndarray:
        values = rng.random(shape, dtype=np.float32)
        values -= np.float32(0.5)
        values *= 2 * half_width
        return values

    arena = WeightArena()

    def matrix(name: str, *shape: int, store=store) -> Linear:
        return store(name, uniform(*shape))

    hidden, inter = config.hidden_size, config.intermediate_size
    qkv_size = config.q_size + 2 * config.kv_size
    layers = [
        LayerWeights(
            input_norm=np.ones(hidden, dtype=np.float32),
            qkv=placed(arena, in_row_groups(matrix(f"layers.{i}.qkv", qkv_size, hidden))),
            qkv_bias=uniform(qkv_size) if config.qkv_bias else None,
            o=placed(arena, in_row_groups(matrix(f"layers.{i}.o", hidden, config.q_size))),
            post_norm=np.ones(hidden, dtype=np.float32),
            gate_up=placed(arena, in_row_groups(matrix(f"layers.{i}.gate_up", 2 * inter, hidden))),
            down=placed(arena, in_panels(in_row_groups(matrix(f"layers.{i}.down", hidden, inter)))),
            q_norm=np.ones(config.head_dim, dtype=np.float32) if config.qk_norm else None,
            k_norm=np.ones(config.head_dim, dtype=np.float32) if config.qk_norm else None,
        )
        for i in range(config.num_layers)
    ]
    vocab = (config.vocab_size, hidden)
    embed = placed(arena, in_row_groups(matrix("embed", *vocab, store=store_embedding)))
    lm_head = (
        embed
        if config.tie_word_embeddings
        else placed(arena, in_row_groups(matrix("lm_head", *vocab, store=store_embedding)))
    )
    final_norm = np.ones(hidden, dtype=np.float32)
    return ModelWeights(embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head)
