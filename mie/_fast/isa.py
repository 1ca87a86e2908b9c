"""Which compiled variant of a kernel module runs: the instruction-set choice both
``mie._fast.linear`` and ``mie._fast.ops`` make, written once.

Each of those modules compiles its C kernels for several instruction sets (best first:
``avx512``, ``avx2``, ``generic``, and for the matrix products ``avx512vnni`` and
``avx2vnni`` above the set each extends; ``mie/_fast/isa.h``) and asks the CPU which it runs. An
``IsaChoice`` holds one module's answer and the variant in use: the best supported one at
import, or the one the ``MIE_ISA`` environment variable names (refused, naming the choices,
if unknown or unsupported); tests and benchmarks switch with ``set`` and pretend to be a
smaller CPU with ``mask``. The kernels read ``index`` on every call, so a switch applies to
the next call on every thread.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

NARROWER = {"avx512vnni": "avx512", "avx2vnni": "avx2"}
"""A variant only some modules have -> what the others run for it: ``MIE_ISA=avx512vnni``
or ``avx2vnni`` (the matrix products' extra variants) means ``avx512`` or ``avx2`` for the
attention kernels."""


class IsaChoice:
    """The variant a kernel module runs, among ``names`` (those compiled, best first)."""

    def __init__(self, names: Iterable[str], runs: Iterable[bool]) -> None:
        self.names = tuple(names)
        self._runs = tuple(runs)  # per name: whether this CPU can run it
        self._masked: frozenset[str] = frozenset()
        self.index = 0
        requested = os.environ.get("MIE_ISA", "").strip()
        if requested not in self.names and requested in NARROWER:
            requested = NARROWER[requested]
        try:
            self.set(requested or self.supported()[0])
        except ValueError as exc:
            raise ValueError(f"MIE_ISA={requested!r}: {exc}") from None

    @property
    def name(self) -> str:
        return self.names[self.index]

    def supported(self) -> tuple[str, ...]:
        """The variants this CPU runs, best first."""
        return tuple(
            name
            for name, runs in zip(self.names, self._runs, strict=True)
            if runs and name not in self._masked
        )

    def set(self, name: str) -> None:
        """Use variant ``name`` from now on; ``ValueError`` if unknown or unsupported."""
        if name not in self.names:
            raise ValueError(
                f"unknown instruction set {name!r}: this build has {', '.join(self.names)}"
            )
        if name not in self.supported():
            raise ValueError(
                f"this CPU cannot run the {name!r} kernels; it supports "
                f"{', '.join(self.supported())}"
            )
        self.index = self.names.index(name)

    def mask(self, names: Iterable[str]) -> None:
        """Tests only: treat ``names`` as unsupported (a smaller CPU); falls back to the best
        variant left if the one in use is masked."""
        self._masked = frozenset(names)
        if self.name in self._masked:
            self.set(self.supported()[0])
