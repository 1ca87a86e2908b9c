"""PNG plots of the mechanism benchmarks (``--plot DIR``; needs the ``plot`` extra)."""

from __future__ import annotations

from pathlib import Path

from mie.bench.simulate import RunResult


def matplotlib_missing() -> str | None:
    """None if matplotlib can be imported, else the one-line message to print."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "--plot needs matplotlib: python -m pip install 'mie[plot]' (or matplotlib)"
    return None


def plot_mechanisms(runs: dict[str, RunResult], pressure: list[dict], folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    paths = []

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, names, title in (
        (axes[0], ("continuous", "static"), "continuous vs static (same pool)"),
        (axes[1], ("paged", "contiguous"), "paged vs contiguous (same budget)"),
    ):
        for name in names:
            ax.plot([t.utilization for t in runs[name].traces], label=name, linewidth=1)
        ax.set(title=title, xlabel="step", ylabel="memory reserved / capacity", ylim=(0, 1.05))
        ax.legend()
    paths.append(_save(fig, folder / "utilization.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, result in runs.items():
        if name.startswith("pool of") and result.total("preemptions"):
            total, cumulative = 0, []
            for t in result.traces:
                total += t.preemptions
                cumulative.append(total)
            ax.plot(cumulative, label=name, linewidth=1)
    ax.set(title="preemptions under memory pressure", xlabel="step", ylabel="preemptions so far")
    ax.legend()
    paths.append(_save(fig, folder / "preemptions.png"))

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    blocks = [p["num_blocks"] for p in pressure]
    for ax, key in zip(axes, ("steps", "preemptions", "recomputed_tokens"), strict=True):
        ax.plot(blocks, [p[key] for p in pressure], marker="o")
        ax.set(xscale="log", xlabel="pool size (blocks)", title=key.replace("_", " "))
    paths.append(_save(fig, folder / "memory_pressure.png"))

    if "whole prefill" in runs and "chunked prefill" in runs:
        paths.append(plot_chunked_prefill(runs["whole prefill"], runs["chunked prefill"], folder))
    return paths


def plot_chunked_prefill(whole: RunResult, chunked: RunResult, folder: Path) -> Path:
    """Benchmark 5: tokens per step over the run, and how often a stream's stall (tokens
    computed between two of its tokens) exceeds a size -- whole prefill's long tail."""
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for name, result in (("whole", whole), ("chunked", chunked)):
        axes[0].plot(result.step_tokens(), label=f"{name} prefill", linewidth=0.8)
        stalls = np.sort(result.stalls())
        exceed = 1.0 - np.arange(len(stalls)) / len(stalls)  # fraction >= each value
        axes[1].step(stalls, exceed, where="post", label=f"{name} prefill")
    axes[0].set(title="tokens computed per step", xlabel="step", ylabel="tokens")
    axes[1].set(
        title="decode stall of running requests",
        yscale="log",
        xlabel="tokens computed between two tokens of a request",
        ylabel="fraction of gaps >= x",
    )
    for ax in axes:
        ax.legend()
    return _save(fig, folder / "chunked_prefill.png")


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
