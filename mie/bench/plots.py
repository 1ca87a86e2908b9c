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
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
