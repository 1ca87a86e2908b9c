"""Log-probabilities: what the model thought of each token, in vLLM's shapes.

They are the log-softmax of the model's *raw* logits -- before ``logit_bias``, the
penalties, temperature and the filters (vLLM's default, ``raw_logprobs``): they describe the
model, not the sampler, so a request's log-probabilities do not change with its sampling
knobs, and a prompt's are the same whatever is generated after it.

At one position, ``position_logprobs`` gives a dict token id -> ``Logprob``: the token that is
there (sampled, or the prompt's next token) first, then the ``k`` most likely tokens, best
first (ties: lower id first). ``rank`` is 1 + the number of tokens strictly more likely, so
tied tokens share a rank (vLLM ranks the top-k by position instead; the two agree without
ties). Computing them costs one O(vocabulary) log-softmax per position, paid only by the
requests that ask.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from mie.engine.outputs import Logprob, PositionLogprobs


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64 (so a position's log-probabilities sum to 1 in exp)."""
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    x -= np.log(np.exp(x).sum(axis=-1, keepdims=True))
    return x


def position_logprobs(
    logprobs: np.ndarray,
    token_id: int,
    k: int,
    decode: Callable[[int], str] | None = None,
) -> PositionLogprobs:
    """The ``token_id`` at this position and the top ``k`` of the (vocab,) ``logprobs`` row;
    ``decode(t)``, where given, is token ``t``'s text at this position (``decoded_token``: in
    context, as the engine's ``IncrementalDetokenizer.peek`` spells it).

    O(vocabulary): one pass finds the tokens at least as likely as the k-th (ties at the cut
    included), and only those are sorted; every token strictly more likely than one of them
    is among them, so their ranks are counted there.
    """
    value = float(logprobs[token_id])
    out = {token_id: Logprob(value, 1 + int(np.count_nonzero(logprobs > value)), None)}
    if k > 0:
        k = min(k, logprobs.size)
        kth = np.partition(logprobs, logprobs.size - k)[logprobs.size - k]
        ids = np.flatnonzero(logprobs >= kth)
        values = logprobs[ids]
        order = np.lexsort((ids, -values))  # best first, ties: lower id first
        sorted_values = values[order]
        for t, v in zip(ids[order[:k]].tolist(), sorted_values[:k].tolist(), strict=True):
            rank = 1 + int(np.searchsorted(-sorted_values, -v, side="left"))
            out.setdefault(t, Logprob(v, rank, None))
    if decode is not None:
        for t, entry in out.items():
            entry.decoded_token = decode(t)
    return out
