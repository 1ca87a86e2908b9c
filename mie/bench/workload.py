"""The benchmark workload: 256 mixed requests from a fixed seed, sized to Qwen2-0.5B.

Lengths, in tokens (every draw from one ``numpy.random.default_rng(seed)``):

* prompt -- 70 % short: lognormal, median 96, sigma 0.6, clipped to [8, 512];
            30 % long: uniform in [512, 1536];
* output -- 70 % short: lognormal, median 48, sigma 0.7, clipped to [4, 256];
            30 % long: uniform in [256, 768]; drawn independently of the prompt;
* max_tokens -- the smallest of 128, 256, 512, 1024 that covers the output: the cap a client
            sets. The model stops earlier, at its end-of-sequence token, as real ones do.

Prompt token ids are uniform over Qwen2's vocabulary (so two prompts share nothing unless a
variant gives them a common system prompt). KV memory is Qwen2-0.5B's: 24 layers x (K, V) x
2 KV heads x 64 dims x 2 bytes = 12,288 bytes per token, in blocks of 16 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

BYTES_PER_TOKEN = 24 * 2 * 2 * 64 * 2  # 12,288
BLOCK_SIZE = 16
BYTES_PER_BLOCK = BYTES_PER_TOKEN * BLOCK_SIZE  # 196,608
VOCAB_SIZE = 151_936
EOS = 151_643  # Qwen2's <|endoftext|>; prompts avoid it
MAX_TOKENS_CAPS = (128, 256, 512, 1024)
NUM_REQUESTS = 256
NUM_REQUESTS_QUICK = 32


@dataclass(frozen=True)
class WorkloadRequest:
    """One request of a simulated workload: what the benchmark's fake model is asked for
    and how long it answers (not the engine's ``mie.engine.request.Request``)."""

    prompt: tuple[int, ...]
    output_len: int  # tokens the model generates, the last being EOS
    max_tokens: int  # the client's cap, >= output_len
    arrival: int = 0  # the step at which it arrives

    @property
    def max_kv_tokens(self) -> int:
        return len(self.prompt) + self.max_tokens - 1


def _lengths(rng: np.random.Generator, n: int, short: tuple, long: tuple) -> np.ndarray:
    median, sigma, low, high = short
    is_long = rng.random(n) < 0.3
    short_len = np.clip(np.round(rng.lognormal(np.log(median), sigma, n)), low, high)
    long_len = rng.integers(long[0], long[1] + 1, n)
    return np.where(is_long, long_len, short_len).astype(int)


def mixed_requests(seed: int, n: int) -> list[WorkloadRequest]:
    """``n`` requests of the mixed workload, all arriving at step 0."""
    rng = np.random.default_rng(seed)
    prompt_lens = _lengths(rng, n, (96, 0.6, 8, 512), (512, 1536))
    output_lens = _lengths(rng, n, (48, 0.7, 4, 256), (256, 768))
    requests = []
    for prompt_len, output_len in zip(prompt_lens, output_lens, strict=True):
        prompt = tuple(int(t) for t in rng.integers(0, EOS, prompt_len))
        max_tokens = next(cap for cap in MAX_TOKENS_CAPS if cap >= output_len)
        requests.append(WorkloadRequest(prompt, int(output_len), max_tokens))
    return requests


def with_system_prompt(
    requests: list[WorkloadRequest], seed: int, length: int
) -> list[WorkloadRequest]:
    """The same requests, each starting with one shared system prompt of ``length`` tokens."""
    rng = np.random.default_rng([seed, length])
    system = tuple(int(t) for t in rng.integers(0, EOS, length))
    return [replace(r, prompt=system + r.prompt) for r in requests]


def spread_out(
    requests: list[WorkloadRequest], seed: int, mean_gap: float
) -> list[WorkloadRequest]:
    """The same requests arriving one by one, exponential gaps of ``mean_gap`` steps."""
    rng = np.random.default_rng([seed, 1])
    arrivals = np.cumsum(np.round(rng.exponential(mean_gap, len(requests))).astype(int))
    return [replace(r, arrival=int(a)) for r, a in zip(requests, arrivals, strict=True)]


def blocks_for(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_SIZE)
