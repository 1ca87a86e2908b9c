"""What the user may ask for: the weights' dtype and quantization, and the KV cache's dtype.

vLLM's names and values. Activations, norms, biases, softmax and every accumulation stay
float32 whatever is chosen here; only what is *stored* gets narrower -- the weight matrices
(``mie.linear`` multiplies float32 activations with them) and the KV cache (the attention
kernels widen it in registers).

* ``dtype``: ``"auto"`` (the checkpoint's own dtype, ``torch_dtype`` / ``dtype`` in its
  ``config.json``; float32 when absent), ``"float32"``, ``"bfloat16"``, ``"float16"``.
* ``quantization``: ``None``, ``"int8"`` or ``"int4"``, weight-only, quantized at load time from
  the weights as ``dtype`` gives them -- so a bfloat16 checkpoint is quantized from its bfloat16
  values. ``"int8"``: llama.cpp's Q8_0, bit for bit -- groups of 32 inputs with a float16 scale
  each, 34 bytes per 32 weights (``mie.linear``). ``"int4"``: llama.cpp's Q4_0, bit for bit --
  blocks of 32 4-bit codes with a float16 scale, 18 bytes per 32 weights; a matrix whose input
  dimension is not a multiple of 32 (stories260K's down projection, 172 inputs) cannot be whole
  Q4_0 blocks and is stored as int8 instead (``mie.model.weights.storage``), and the embedding
  and LM head are int6, a 6-bit format of mie's own (``embedding_quantization``).
* ``kv_cache_dtype``: ``"auto"`` (float32, exact), ``"float32"``, ``"bfloat16"``,
  ``"float16"``: the same ``kv_cache_memory`` holds twice the tokens in 16 bits.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from mie.checks import short_repr

DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = (None, "int8", "int4")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")

NUMPY_DTYPES = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
}
"""How each stored dtype lives in NumPy: bfloat16 is ``ml_dtypes.bfloat16``."""


def _check_choice(value: object, allowed: tuple, name: str) -> None:
    if not any(
        value is choice or (isinstance(value, str) and value == choice) for choice in allowed
    ):
        raise ValueError(f"{name} must be one of {list(allowed)}, got {short_repr(value)}")


def resolve_dtype(dtype: object, checkpoint_dtype: str) -> str:
    """The dtype the weights are stored in (before any quantization); ``ValueError`` naming
    the allowed values for an unknown one."""
    _check_choice(dtype, DTYPES, "dtype")
    return checkpoint_dtype if dtype == "auto" else str(dtype)


def check_quantization(quantization: object) -> None:
    """``ValueError`` naming the allowed values unless ``quantization`` is one of them."""
    _check_choice(quantization, QUANTIZATIONS, "quantization")


def kv_cache_numpy_dtype(kv_cache_dtype: object) -> np.dtype:
    """The NumPy dtype of the KV cache's elements; ``ValueError`` for an unknown name."""
    _check_choice(kv_cache_dtype, KV_CACHE_DTYPES, "kv_cache_dtype")
    return NUMPY_DTYPES["float32" if kv_cache_dtype == "auto" else kv_cache_dtype]
