"""The baseline people use today: Hugging Face transformers' ``generate`` in static batches.

A static batch is padded on the left to its longest prompt and runs until its longest output
is done; every request in it waits for the slowest. Only each request's own output tokens are
counted as useful, exactly as for mie, so the padding and the idle tail are visible as waste.
Runs only when torch and transformers are installed (the ``bench`` extra).
"""

from __future__ import annotations

import time
from dataclasses import dataclass


def available() -> bool:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class StaticBatchResult:
    useful_tokens: int
    generated_tokens: int  # including the tokens past each request's own length
    seconds: float

    @property
    def useful_tokens_per_s(self) -> float:
        return self.useful_tokens / self.seconds


def build_model(hf_config: dict, seed: int):
    """A transformers model with random weights, in float32 on the CPU."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(**hf_config)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def generate_static(
    model, prompts: list[list[int]], output_lens: list[int], batch_size: int
) -> StaticBatchResult:
    """Greedy generation of every request, ``batch_size`` at a time, left-padded."""
    import torch

    useful = generated = 0
    start = time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        batch = prompts[first : first + batch_size]
        lens = output_lens[first : first + batch_size]
        width = max(len(p) for p in batch)
        input_ids = torch.zeros((len(batch), width), dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, prompt in enumerate(batch):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt) :] = 1
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                do_sample=False,
                max_new_tokens=max(lens),
                min_new_tokens=max(lens),  # random weights: never stop early on an EOS
                pad_token_id=0,
            )
        useful += sum(lens)
        generated += (out.shape[1] - width) * len(batch)
    return StaticBatchResult(useful, generated, time.perf_counter() - start)
