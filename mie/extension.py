"""Whether the compiled extension (``mie._fast``) can be used, why not, and which backend to run.

Two implementations run the hot loops: the pure-Python reference (``mie.memory``,
``mie.scheduler``, ``mie.ops``) and its Cython mirror (``mie._fast``). This module, at the
bottom of the layers, decides which one a caller gets -- first match wins:

1. an explicit name (e.g. the engine's ``backend=`` argument): ``"python"`` or ``"fast"``;
2. the ``MIE_BACKEND`` environment variable, same values;
3. ``"fast"`` if the extension modules were built at install time, else ``"python"``.

Asking for ``"fast"`` when it is not built raises ``BackendUnavailableError`` rather than
quietly running the slow path: a benchmark or a test that wants the fast code must get it.

When the fast backend cannot be imported, ``fast_unavailable_reason()`` says why and what to
do, telling apart a build that is really missing from one that exists but is *shadowed*: after
``pip install .`` the compiled modules live in site-packages, yet ``python -m`` run from the
source tree puts the current directory first on ``sys.path``, so ``import mie`` finds the
source tree's ``mie/`` (no ``.so`` files) and never sees them. The benchmark prints this reason,
and so does the error for ``backend="fast"`` / ``MIE_BACKEND=fast``.

``mie.kernels`` (what the model computes with) and ``mie.backend`` (the allocator and scheduler
classes the engine builds) both choose through ``backend_name``.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import shutil
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path

BACKENDS = ("python", "fast")
ENV_VAR = "MIE_BACKEND"
PACKAGE_DIR = Path(__file__).resolve().parent
"""The ``mie`` package Python imported: where its ``_fast`` build is looked for first."""


class BackendUnavailableError(RuntimeError):
    """The fast backend was asked for, but ``mie._fast`` was not built."""


def backend_name(name: str | None = None) -> str:
    """``"python"`` or ``"fast"``: ``name``, else ``MIE_BACKEND``, else the best one built.

    Raises ``ValueError`` for an unknown name and ``BackendUnavailableError`` when ``"fast"``
    is asked for but cannot be imported (with the reason and the fix).
    """
    source = "argument"
    if name is None:
        name, source = os.environ.get(ENV_VAR) or None, ENV_VAR
    if name is None:
        return "fast" if fast_available() else "python"
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r} (from the {source}); choose one of {BACKENDS}")
    if name == "fast" and not fast_available():
        raise BackendUnavailableError(
            "the fast backend was asked for and cannot be imported. "
            f"{fast_unavailable_reason()}. To run without it, choose the pure-Python backend "
            f"with {ENV_VAR}=python"
        )
    return name


# The compiled modules the fast backend is made of (mie._fast.linear joins them when the model
# computes with reduced-precision weights).
FAST_MODULES = (
    "mie._fast.ops",
    "mie._fast.memory",
    "mie._fast.prefix_cache",
    "mie._fast.scheduler",
    "mie._fast.inputs",
)


def _import_fast() -> None:
    """Import every compiled module of the fast backend; ImportError if one is missing."""

    for name in FAST_MODULES:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            raise ImportError(explain_missing_build(exc)) from exc


def fast_available() -> bool:
    """Whether the Cython extension modules were built and import cleanly."""
    try:
        _import_fast()
    except ImportError:
        return False
    return True


def fast_unavailable_reason() -> str | None:
    """``None`` when ``mie._fast`` imports; otherwise why it does not, and how to fix it."""
    try:
        _import_fast()
    except ImportError as exc:
        # mie._fast re-raises a missing module with its own message; diagnose the original.
        cause = exc.__cause__ if isinstance(exc.__cause__, ImportError) else exc
        return explain_missing_build(cause)
    return None


def explain_missing_build(
    error: BaseException,
    package_dir: str | os.PathLike | None = None,
    search_path: Sequence[str] | None = None,
) -> str:
    """Why ``mie._fast`` failed to import with ``error``, and the command that fixes it.

    ``package_dir`` is the ``mie`` package Python imported (default: this one) and
    ``search_path`` the import path (default: ``sys.path``); both are parameters so that the
    diagnosis can be tested on a made-up layout. Three cases, checked in this order:

    * the imported package has compiled modules for this Python, so they are broken (built
      for another NumPy, a missing library): say so with the import error;
    * another ``mie/_fast`` on the import path holds a build (``pip install .`` put it in
      site-packages): the imported package shadows it, name both paths;
    * no build anywhere: really not built; say whether a C compiler is on the PATH.
    """
    package = Path(package_dir if package_dir is not None else PACKAGE_DIR).resolve()
    search_path = list(sys.path if search_path is None else search_path)
    fast_dir = package / "_fast"
    fix = _build_command(package)
    raised = f"{type(error).__name__}: {error}"
    if _extension_modules(fast_dir):
        return f"mie._fast is built in {fast_dir} but does not import ({raised}); rebuild it: {fix}"
    builds = [d for d in _other_builds(search_path) if d != fast_dir]
    if builds:
        return (
            f"mie._fast is built in {builds[0]}, but Python imports mie from {package}, which "
            f"has no compiled modules and comes first on the import path (python -m and "
            f"scripts put the current directory first), so it hides the build. Fix: build in "
            f"place with {fix} (or run from another directory)"
        )
    foreign = _extension_modules(fast_dir, any_python=True)
    compiler = _c_compiler()
    why = (
        f"there are compiled modules in {fast_dir}, but for another Python ({foreign[0].name}), "
        if foreign
        else f"there are no compiled modules in {fast_dir} ({raised}); "
    )
    how = (
        f"with a C compiler on the PATH ({compiler}), build it with {fix} "
        "(add -v to see the compiler's output if it fails)"
        if compiler
        else f"no C compiler was found on the PATH: install one (e.g. gcc), then run {fix}"
    )
    return f"mie._fast is not built: {why}{how}"


def _extension_modules(folder: Path, any_python: bool = False) -> list[Path]:
    """The compiled modules in ``folder``: for this interpreter, or for any (``any_python``)."""
    try:
        return sorted(p for p in folder.iterdir() if _is_extension(p.name, any_python))
    except OSError:  # not a folder, or unreadable: no build there that Python could import
        return []


def _is_extension(name: str, any_python: bool = False) -> bool:
    """Whether ``name`` is a compiled module's file name that this interpreter would import
    (``ops.cpython-311-x86_64-linux-gnu.so`` on CPython 3.11, not ``ops.cpython-310-...``),
    or, with ``any_python``, one for any interpreter."""
    if any_python:
        return name.endswith((".so", ".pyd"))
    _, dot, tail = name.partition(".")
    return bool(dot) and dot + tail in importlib.machinery.EXTENSION_SUFFIXES


def _other_builds(search_path: Sequence[str]) -> list[Path]:
    """Every ``mie/_fast`` folder with compiled modules on ``search_path``, in import order.

    ``pip install .`` puts its build in site-packages, which is on the path, so this finds it.
    """
    found: list[Path] = []
    for entry in search_path:
        if not isinstance(entry, str):
            continue
        folder = (Path(entry or os.getcwd()) / "mie" / "_fast").resolve()
        if folder not in found and _extension_modules(folder):
            found.append(folder)
    return found


def _build_command(package: Path) -> str:
    """The command that builds the extension for the package in ``package``."""
    root = package.parent
    if (root / "setup.py").is_file():
        return f"cd {root} && python -m pip install -e ."
    return "python -m pip install -e . from mie's source tree"


def _c_compiler() -> str | None:
    """The C compiler setuptools would call, if it is on the PATH."""
    command = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()
    return shutil.which(command[0]) if command else None
