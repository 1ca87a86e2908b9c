"""Benchmarks: ``python -m mie.bench``."""

from pathlib import Path

STORIES260K = Path(__file__).resolve().parents[2] / "models" / "stories260K"
"""The trained tiny Llama the repository ships (models/stories260K, with its README)."""
