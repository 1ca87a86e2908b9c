"""``python -m mie.bench --cuda``: paged-attention decode on the GPU, against the memory roofline.

Decode attention reads every cached K and V row once and does little arithmetic per byte, so
its yardstick is memory bandwidth: for batch 1-256 and contexts 512-8192 with Qwen2-0.5B's
head shapes (14 query heads over 2 KV heads, head_dim 64, float32, blocks of 16 tokens
scattered at random over the arena) this prints the decode time of ``mie.cuda.ops
.paged_attention``, the K/V bytes it read per second, and that as a share of the GPU's peak
bandwidth (memory clock x bus width, as the driver reports them). Next to it, when torch with
CUDA is present: PyTorch's ``scaled_dot_product_attention`` over the same context stored
contiguously -- the layout paging gives up -- as a reference.

Times are CUDA-event times per call, averaged over back-to-back calls after a warm-up, and
include each call's Python overhead (argument checks, buffer allocation, launches): that is
what the engine pays per layer. Every shape's batch-1 output is first checked against the
NumPy reference, so a broken kernel cannot post a figure.

Without a GPU it prints one line saying why and exits with status 1.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass

import numpy as np

from mie import ops
from mie.bench.section import SectionResult
from mie.bench.table import table
from mie.cuda import CudaUnavailableError, get_device
from mie.cuda import ops as cuda_ops

BLOCK_SIZE = 16
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 14, 2, 64  # Qwen2-0.5B
SCALE = HEAD_DIM**-0.5
BATCHES, CONTEXTS = (1, 4, 16, 64, 256), (512, 2048, 8192)
QUICK_BATCHES, QUICK_CONTEXTS = (1, 16), (512, 2048)


@dataclass
class Row:
    batch: int
    context: int
    kv_bytes: int  # K and V bytes one call reads
    mie_ms: float
    torch_ms: float | None  # contiguous-KV SDPA, when torch has CUDA

    @property
    def mie_bandwidth(self) -> float:
        return self.kv_bytes / (self.mie_ms * 1e-3)


def section(args: argparse.Namespace) -> SectionResult:
    """``python -m mie.bench --cuda``: ``run`` prints its table as it goes; keep the rows."""
    return SectionResult({"cuda": [asdict(row) for row in run(args)]}, report="")


def run(args: argparse.Namespace) -> list[Row]:
    """Benchmark decode attention on the GPU; print a table and return its rows.

    ``args.quick`` (optional, default False) shrinks the grid for a smoke run. Raises
    ``SystemExit`` with a one-line reason (exit status 1) when no CUDA GPU can be used.
    """
    quick = getattr(args, "quick", False)
    try:
        device = get_device()
    except CudaUnavailableError as exc:
        raise SystemExit(f"mie.bench --cuda: no CUDA GPU to benchmark: {exc}") from None
    batches, contexts = (QUICK_BATCHES, QUICK_CONTEXTS) if quick else (BATCHES, CONTEXTS)
    repeats = 5 if quick else 20
    torch = _torch_with_cuda()

    peak = device.peak_bandwidth
    print(f"GPU: {device.device_name} via {device.name}, {device.multiprocessor_count} SMs")
    print(f"peak DRAM bandwidth: {peak / 1e9:.0f} GB/s" if peak else "peak bandwidth: unknown")
    print(
        f"paged_attention decode, {NUM_HEADS} heads / {NUM_KV_HEADS} KV heads x {HEAD_DIM}, "
        f"float32, blocks of {BLOCK_SIZE}; torch SDPA on contiguous K/V: "
        f"{'yes' if torch else 'not available (needs torch with CUDA)'}"
    )
    rng = np.random.default_rng(0)
    blocks_needed = max(batches) * -(-max(contexts) // BLOCK_SIZE)
    host_arena = rng.standard_normal(
        (blocks_needed, 1, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), dtype=np.float32
    )
    arena = device.to_device(host_arena)
    k_cache, v_cache = arena[:, 0, 0], arena[:, 0, 1]

    rows = []
    for context in contexts:
        for batch in batches:
            blocks = -(-context // BLOCK_SIZE)
            tables = rng.permutation(blocks_needed)[: batch * blocks].astype(np.int32)
            tables = tables.reshape(batch, blocks)
            lens = np.full(batch, context, np.int32)
            q = rng.standard_normal((batch, NUM_HEADS, HEAD_DIM), dtype=np.float32)
            if batch == batches[0]:
                _check(device, q, host_arena, k_cache, v_cache, tables, lens)
            q_dev, tables_dev, lens_dev = (device.to_device(a) for a in (q, tables, lens))

            def decode(q_dev=q_dev, tables_dev=tables_dev, lens_dev=lens_dev):
                cuda_ops.paged_attention(
                    q_dev, k_cache, v_cache, tables_dev, lens_dev, SCALE, device=device
                )

            decode()  # compile on first use, warm the allocator
            mie_ms = device.elapsed_ms(decode, repeats)
            torch_ms = _torch_sdpa_ms(torch, batch, context, repeats) if torch else None
            kv_bytes = batch * context * 2 * NUM_KV_HEADS * HEAD_DIM * 4
            rows.append(Row(batch, context, kv_bytes, mie_ms, torch_ms))
    _print_table(rows, peak)
    return rows


def _check(device, q, host_arena, k_cache, v_cache, tables, lens) -> None:
    """The GPU result must match the NumPy reference before any time counts."""
    expected = ops.paged_attention(q, host_arena[:, 0, 0], host_arena[:, 0, 1], tables, lens, SCALE)
    actual = cuda_ops.paged_attention(q, k_cache, v_cache, tables, lens, SCALE, device=device)
    error = float(np.max(np.abs(actual - expected)))
    if error > 1e-4:
        raise AssertionError(f"CUDA paged_attention is off by {error} at context {lens[0]}")


def _torch_with_cuda():
    """torch, if it is installed with a usable CUDA device; else None."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def _torch_sdpa_ms(torch, batch: int, context: int, repeats: int) -> float:
    """Mean time of SDPA for one decode token over a contiguous (batch, kvh, context, hd) K/V."""
    q = torch.randn(batch, NUM_HEADS, 1, HEAD_DIM, device="cuda")
    k = torch.randn(batch, NUM_KV_HEADS, context, HEAD_DIM, device="cuda")
    v = torch.randn_like(k)
    attention = torch.nn.functional.scaled_dot_product_attention

    def decode():
        attention(q, k, v, scale=SCALE, enable_gqa=True)

    decode()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        decode()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / repeats


def _print_table(rows: list[Row], peak: float | None) -> None:
    """An aligned text table, like the other sections'."""
    cells = []
    for r in rows:
        torch = "-"
        if r.torch_ms is not None:
            torch = f"{r.torch_ms:.3f} ms, {r.kv_bytes / (r.torch_ms * 1e-3) / 1e9:.0f} GB/s"
        cells.append(
            [
                r.batch,
                r.context,
                f"{r.kv_bytes / 2**20:.1f} MiB",
                f"{r.mie_ms:.3f} ms",
                f"{r.mie_bandwidth / 1e9:.0f}",
                f"{100 * r.mie_bandwidth / peak:.0f}%" if peak else "-",
                torch,
            ]
        )
    headers = [
        "batch",
        "context",
        "K/V read",
        "mie",
        "mie GB/s",
        "% of peak",
        "torch SDPA (contiguous)",
    ]
    print(table(headers, cells))


if __name__ == "__main__":
    run(argparse.Namespace(quick=False))
