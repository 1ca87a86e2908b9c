"""mie's layers only look down: each module, imported alone, pulls in no module of a layer above.

Every module of the package (the ``.py`` files and the compiled ``mie._fast`` modules) is
imported in a fresh interpreter of its own, which records which other mie modules that import
loaded and who imported each. A module may pull in modules of its own layer and of the layers
``MAY_IMPORT`` lists below it, nothing else; a failure names the import chain that goes up, e.g.
``mie.memory.pool (memory) pulls in mie.scheduler (scheduler): mie.memory.pool -> mie.scheduler``.

"Below" is a partial order, not a line: the kernels (``mie.ops`` and friends) and the allocator
and scheduler are independent of each other, the model needs the kernels and the memory
layout but not the scheduler, the engine puts them together (through ``mie.backend``), and the
server, the CLI and the benchmarks sit on top. The CUDA kernels stand alone.

A package's ``__init__`` belongs to the package's layer; importing any module of a package
imports its ``__init__`` too, so what an ``__init__`` imports is pulled in by all its modules.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import mie

PACKAGE = Path(mie.__file__).resolve().parent

# layer -> its modules; "pkg.*" is the package ``pkg`` and every module in it.
LAYERS: dict[str, list[str]] = {
    "base": ["mie", "mie.checks", "mie.extension", "mie.progress", "mie.checkpoint"],
    # The kernels are array functions that import nothing of mie but the base layer; mie._fast's
    # __init__ loads the compiled ones (the module linked with OpenMP), so it sits with them.
    "kernels": [
        "mie.ops",
        "mie.kernels",
        "mie.linear",
        "mie._fast",
        "mie._fast.ops",
        "mie._fast.linear",
        "mie._fast.isa",
    ],
    "memory": ["mie.memory.*", "mie._fast.memory"],
    "scheduler": ["mie.scheduler.*", "mie._fast.prefix_cache", "mie._fast.scheduler"],
    "model": ["mie.model.*"],
    "backend": ["mie.backend"],
    "engine": ["mie.engine.*"],
    "serve": ["mie.serve.*"],
    "cli": ["mie.cli", "mie.__main__"],
    "cuda": ["mie.cuda.*"],
    "bench": ["mie.bench.*", "mie._fast.bench"],
}

# layer -> the other layers its modules may pull in (each may pull in its own).
MAY_IMPORT: dict[str, set[str]] = {
    "base": set(),
    "kernels": {"base"},
    "memory": {"base", "kernels"},  # the compiled allocator loads through mie._fast
    "scheduler": {"base", "kernels", "memory"},
    "model": {"base", "memory", "kernels"},
    "backend": {"base", "memory", "scheduler", "kernels"},
    "engine": {"base", "memory", "scheduler", "kernels", "model", "backend"},
    "serve": {"base", "memory", "scheduler", "kernels", "model", "backend", "engine"},
    "cli": {"base", "memory", "scheduler", "kernels", "model", "backend", "engine", "serve"},
    "cuda": {"base"},
    "bench": {"base", "memory", "scheduler", "kernels", "model", "backend", "engine", "serve"}
    | {"cli", "cuda"},
}

# Run in the fresh interpreter: import sys.argv[1] alone and print, as JSON, every mie module
# that loaded and, for each, the module whose code was running when it was imported (None for
# the module itself and the packages above it). sys.argv[2:] name injected imports,
# "A=B": right after A's code ran, B is imported from it (the negative control below).
PROBE = r"""
import importlib, importlib.abc, json, sys

target, injected = sys.argv[1], dict(arg.split("=") for arg in sys.argv[2:])
importer, running = {}, []

class Recorder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target_module=None):
        if name != "mie" and not name.startswith("mie."):
            return None
        for finder in sys.meta_path:
            spec = None if finder is self else finder.find_spec(name, path, target_module)
            if spec is not None:
                break
        else:
            return None
        importer[name] = running[-1] if running else None
        exec_module = spec.loader.exec_module

        def exec_recorded(module):
            running.append(name)
            try:
                exec_module(module)
                if name in injected:
                    importlib.import_module(injected[name])
            finally:
                running.pop()

        spec.loader.exec_module = exec_recorded
        return spec

sys.meta_path.insert(0, Recorder())
try:
    importlib.import_module(target)
except ImportError as error:
    print(json.dumps({"error": repr(error), "missing": getattr(error, "name", None)}))
else:
    print(json.dumps({"importer": importer}))
"""


def layer_of(module: str, layers: dict[str, list[str]] = LAYERS) -> str | None:
    """The layer ``module`` belongs to (the most specific entry wins), or None if unlisted."""
    best, best_len = None, -1
    for layer, names in layers.items():
        for name in names:
            package = name.removesuffix(".*")
            exact = module == package
            inside = name.endswith(".*") and module.startswith(package + ".")
            if (exact or inside) and len(package) > best_len:
                best, best_len = layer, len(package)
    return best


def mie_modules() -> list[str]:
    """Every module of the package: its .py files and the compiled mie._fast modules."""
    names = set()
    for path in [*PACKAGE.rglob("*.py"), *PACKAGE.glob("_fast/*.pyx")]:
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if "__pycache__" in parts:
            continue
        names.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return sorted(names)


def probe(module: str, *injected: str) -> dict:
    """Import ``module`` alone in a fresh interpreter (see ``PROBE``)."""
    result = subprocess.run(
        [sys.executable, "-c", PROBE, module, *injected],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=PACKAGE.parent,
    )
    assert result.returncode == 0, f"importing {module} alone failed:\n{result.stderr}"
    return json.loads(result.stdout.splitlines()[-1])


def import_chain(module: str, target: str, importer: dict[str, str | None]) -> list[str]:
    """The shortest chain of imports from ``module`` to ``target``: each step is an import
    statement that ran in the previous module, or a module's own package (imported with it)."""
    edges: dict[str, set[str]] = {}
    for name, by in importer.items():
        if by is not None:
            edges.setdefault(by, set()).add(name)
        if "." in name:
            edges.setdefault(name, set()).add(name.rpartition(".")[0])
    previous: dict[str, str] = {}
    queue = deque([module])
    while queue:
        name = queue.popleft()
        if name == target:
            chain = [target]
            while chain[-1] != module:
                chain.append(previous[chain[-1]])
            return chain[::-1]
        for nxt in sorted(edges.get(name, ())):
            if nxt not in previous and nxt != module:
                previous[nxt] = name
                queue.append(nxt)
    return [module, "?", target]


def upward_imports(
    module: str,
    importer: dict[str, str | None],
    layers: dict[str, list[str]] = LAYERS,
    may_import: dict[str, set[str]] = MAY_IMPORT,
) -> list[str]:
    """One line per module ``module`` pulled in from a layer it may not import."""
    own = layer_of(module, layers)
    allowed = {own} | may_import[own]
    found = []
    for name in sorted(importer):
        layer = layer_of(name, layers)
        if layer not in allowed:
            chain = " -> ".join(import_chain(module, name, importer))
            found.append(f"{module} ({own}) pulls in {name} ({layer}): {chain}")
    return found


@pytest.fixture(scope="module")
def probes() -> dict[str, dict]:
    """Every module imported alone, a few interpreters at a time."""
    modules = mie_modules()
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        return dict(zip(modules, pool.map(probe, modules), strict=True))


def imported(probes: dict[str, dict], module: str) -> dict[str, str | None]:
    """What importing ``module`` alone loaded; skips it when a package it needs is missing
    (except under CI, where the test extras and the compiled extension are installed)."""
    result = probes[module]
    if "error" in result:
        missing = (result["missing"] or "").partition(".")[0]
        if os.environ.get("CI") or missing in ("", "mie"):
            pytest.fail(f"importing {module} alone failed: {result['error']}")
        pytest.skip(f"{module} needs {missing}, not installed")
    return result["importer"]


def test_every_module_has_a_layer():
    unlisted = [m for m in mie_modules() if layer_of(m) is None]
    assert not unlisted, f"put these modules in a layer of LAYERS: {unlisted}"
    assert set(MAY_IMPORT) == set(LAYERS)


@pytest.mark.parametrize("module", mie_modules())
def test_module_pulls_in_only_its_layer_and_those_below(probes, module):
    violations = upward_imports(module, imported(probes, module))
    if violations:
        pytest.fail("upward imports:\n" + "\n".join(violations), pytrace=False)


def test_import_mie_alone_loads_no_submodule(probes):
    # mie/__init__.py resolves its exports on first use: importing it loads nothing else
    assert sorted(imported(probes, "mie")) == ["mie"]


def test_import_mie_memory_loads_no_scheduler_model_or_engine(probes):
    loaded = imported(probes, "mie.memory")
    assert {layer_of(m) for m in loaded} <= {"base", "memory"}, sorted(loaded)


# -- negative controls: the check sees an upward import when there is one --------------------
def test_an_injected_upward_import_is_caught_with_its_chain():
    # a real upward import in the probe: right after mie.checks (base) runs, it imports the
    # scheduler; mie.memory.pool imports mie.checks, so it now pulls in the scheduler too
    importer = probe("mie.memory.pool", "mie.checks=mie.scheduler")["importer"]
    violations = upward_imports("mie.memory.pool", importer)
    assert violations, "the injected import of mie.scheduler went unnoticed"
    assert any(
        v.startswith("mie.memory.pool (memory) pulls in mie.scheduler (scheduler): ")
        and v.endswith("mie.checks -> mie.scheduler")
        for v in violations
    ), violations


def test_a_module_moved_to_a_higher_layer_is_reported(probes):
    # the same recorded imports against a table in which mie.checks sat in the engine layer
    layers = {layer: [m for m in names if m != "mie.checks"] for layer, names in LAYERS.items()}
    layers["engine"].append("mie.checks")
    loaded = imported(probes, "mie.memory.table")
    violations = upward_imports("mie.memory.table", loaded, layers)
    assert violations and violations[0].startswith(
        "mie.memory.table (memory) pulls in mie.checks (engine): mie.memory.table -> "
    ), violations
