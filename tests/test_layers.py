"""mie's layers only look down: each module, imported alone, pulls in no module of a layer above.

Every module of the package (the ``.py`` files and the compiled ``mie._fast`` modules) is
imported in a fresh interpreter of its own, which records which other mie modules that import
loaded and who imported each. A module may pull in modules of its own layer and of the layers
``MAY_IMPORT`` lists below it, nothing else; a failure names the import chain that goes up, e.g.
``mie.memory.pool (memory) pulls in mie.scheduler (scheduler): mie.memory.pool -> mie.scheduler``.

"Below" is a partial order, not a line: the kernels (``mie.ops`` and friends) and the allocator
and scheduler are independent of each other, the model needs the kernels and the memory
layout but not the scheduler, ``mie.backend`` names one implementation of each (and how its
scheduler's batches become the model's inputs), the engine puts them together, and the
server, the CLI and the benchmarks sit on top. The CUDA kernels stand alone.

A package's ``__init__`` belongs to the package's layer; importing any module of a package
imports its ``__init__`` too, so what an ``__init__`` imports is pulled in by all its modules.

Three more rules: the compiled modules of ``mie._fast`` all sit at or below the model (the
benchmarks' compiled drivers live in ``mie.bench``); ``mie.serve.router``, plain Python over
plain data, loads no web framework and no other mie module; and no two mie modules import each
other, directly or around a longer circle (read from the sources, function-level imports
included, ``if TYPE_CHECKING:`` blocks not).
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import mie

PACKAGE = Path(mie.__file__).resolve().parent

# layer -> its modules; "pkg.*" is the package ``pkg`` and every module in it.
LAYERS: dict[str, list[str]] = {
    "base": [
        "mie",
        "mie.checks",
        "mie.extension",
        "mie.progress",
        "mie.checkpoint",
        "mie.gguf_file",
    ],
    # The kernels are array functions that import nothing of mie but the base layer; mie._fast's
    # __init__ loads the compiled ones (the module linked with OpenMP), so it sits with them.
    "kernels": [
        "mie.ops",
        "mie.kernels",
        "mie.kernels_threads",
        "mie.linear",
        "mie._fast",
        "mie._fast.ops",
        "mie._fast.linear",
        "mie._fast.forward",
        "mie._fast.isa",
    ],
    "memory": ["mie.memory.*", "mie._fast.memory"],
    "scheduler": ["mie.scheduler.*", "mie._fast.prefix_cache", "mie._fast.scheduler"],
    "model": ["mie.model.*", "mie._fast.inputs"],
    "backend": ["mie.backend"],
    "engine": ["mie.engine.*"],
    "serve": ["mie.serve.*"],
    "cli": ["mie.cli", "mie.__main__"],
    "cuda": ["mie.cuda.*"],
    "bench": ["mie.bench.*"],
}

# layer -> the other layers its modules may pull in (each may pull in its own).
MAY_IMPORT: dict[str, set[str]] = {
    "base": set(),
    "kernels": {"base"},
    "memory": {"base", "kernels"},  # the compiled allocator loads through mie._fast
    "scheduler": {"base", "kernels", "memory"},
    "model": {"base", "memory", "kernels"},
    "backend": {"base", "memory", "scheduler", "kernels", "model"},  # prepare_inputs
    "engine": {"base", "memory", "scheduler", "kernels", "model", "backend"},
    "serve": {"base", "memory", "scheduler", "kernels", "model", "backend", "engine"},
    "cli": {"base", "memory", "scheduler", "kernels", "model", "backend", "engine", "serve"},
    "cuda": {"base"},
    "bench": {"base", "memory", "scheduler", "kernels", "model", "backend", "engine", "serve"}
    | {"cli", "cuda"},
}

# The layers the compiled mirrors of mie._fast may belong to: at most the model's
# (mie._fast.inputs mirrors mie.model.inputs).
COMPILED_MIRROR_LAYERS = {"kernels", "memory", "scheduler", "model"}

# Run in the fresh interpreter: import sys.argv[1] alone and print, as JSON, every mie module
# that loaded and, for each, the module whose code was running when it was imported (None for
# the module itself and the packages above it), and the top-level names of the other packages
# it loaded ("external"). sys.argv[2:] name injected imports, "A=B": right after A's code ran,
# B is imported from it (the negative controls below).
PROBE = r"""
import importlib, importlib.abc, json, sys

target, injected = sys.argv[1], dict(arg.split("=") for arg in sys.argv[2:])
importer, running = {}, []
before = {name.partition(".")[0] for name in sys.modules}

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
    loaded = {name.partition(".")[0] for name in sys.modules} - before - {"mie"}
    print(json.dumps({"importer": importer, "external": sorted(loaded)}))
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


def module_files() -> dict[str, Path]:
    """Every module of the package, by name: its .py files and its Cython modules (.pyx)."""
    files = {}
    for path in [*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.pyx")]:
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if "__pycache__" in parts:
            continue
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def mie_modules() -> list[str]:
    """Every module of the package: its .py files and the compiled modules."""
    return sorted(module_files())


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


# -- the compiled mirrors sit at or below the model --------------------------------------------
def compiled_mirrors_above_the_model(
    modules: list[str], layers: dict[str, list[str]] = LAYERS
) -> list[str]:
    """The modules of ``mie._fast`` whose layer is above the model's (or none)."""
    compiled = [m for m in modules if m == "mie._fast" or m.startswith("mie._fast.")]
    return [
        f"{m} ({layer_of(m, layers)})"
        for m in compiled
        if layer_of(m, layers) not in COMPILED_MIRROR_LAYERS
    ]


def test_compiled_mirrors_sit_at_or_below_the_model():
    # with the test above (each module pulls in only its layer and those below), no compiled
    # module of mie._fast imports the engine, the server or the benchmarks
    assert not compiled_mirrors_above_the_model(mie_modules())


def test_a_compiled_module_in_a_higher_layer_is_reported():
    # the layout before the benchmarks' driver moved out: mie._fast.bench, in the bench layer
    layers = {**LAYERS, "bench": [*LAYERS["bench"], "mie._fast.bench"]}
    found = compiled_mirrors_above_the_model([*mie_modules(), "mie._fast.bench"], layers)
    assert found == ["mie._fast.bench (bench)"]


def test_a_compiled_mirror_importing_the_benchmarks_is_caught():
    # right after the compiled allocator runs, it imports a benchmark module
    result = probe("mie._fast.memory", "mie._fast.memory=mie.bench.workload")
    if "error" in result:
        pytest.skip(f"mie._fast is not built: {result['error']}")
    violations = upward_imports("mie._fast.memory", result["importer"])
    assert any(
        v.startswith("mie._fast.memory (memory) pulls in mie.bench.workload (bench): ")
        for v in violations
    ), violations


# -- the router is plain Python ------------------------------------------------------------------
ROUTER = "mie.serve.router"
WEB_FRAMEWORKS = {"starlette", "uvicorn"}


def router_violations(result: dict) -> list[str]:
    """What importing the router alone loaded beyond itself and its packages' lazy __init__s."""
    extra_mie = sorted(set(result["importer"]) - {"mie", "mie.serve", ROUTER})
    web = sorted(WEB_FRAMEWORKS & set(result["external"]))
    return [f"loads mie module {m}" for m in extra_mie] + [f"loads {w}" for w in web]


def test_the_router_loads_no_web_framework_and_no_other_mie_module(probes):
    imported(probes, ROUTER)  # fails (or skips) when the import itself failed
    violations = router_violations(probes[ROUTER])
    assert not violations, "\n".join(violations)


def test_an_eager_serve_package_is_caught():
    # as if mie/serve/__init__.py imported the app eagerly: right after it runs, it does
    result = probe(ROUTER, "mie.serve=mie.serve.app")
    if "error" in result:
        pytest.skip(f"the server's packages are not installed: {result['error']}")
    violations = router_violations(result)
    assert "loads mie module mie.serve.app" in violations, violations
    assert "loads starlette" in violations, violations


# -- no import cycles --------------------------------------------------------------------------
# Cython's import lines: "from a.b cimport c, d", "import a.b", "cimport a".
CYTHON_IMPORT = re.compile(
    r"^[ \t]*(?:from[ \t]+(\.*)([\w.]*)[ \t]+c?import[ \t]+([\w ,]+)|c?import[ \t]+([\w.]+))",
    re.MULTILINE,
)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def import_statements(
    source: str, cython: bool = False, type_checking: bool = False
) -> Iterator[tuple[int, str, list[str]]]:
    """Each import in ``source`` as (level, module, names): ``import a.b`` is (0, "a.b", []),
    ``from ..c import d, e`` is (2, "c", ["d", "e"]). Imports inside functions count; those in
    an ``if TYPE_CHECKING:`` body only when ``type_checking`` (they never run)."""
    if cython:
        for dots, module, names, plain in CYTHON_IMPORT.findall(source):
            if plain:
                yield 0, plain, []
            else:
                yield len(dots), module, [n.split()[0] for n in names.split(",") if n.strip()]
        return
    pending: list[ast.AST] = [ast.parse(source)]
    while pending:
        node = pending.pop()
        if isinstance(node, ast.Import):
            yield from ((0, alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            yield node.level, node.module or "", [alias.name for alias in node.names]
        elif isinstance(node, ast.If) and _is_type_checking(node.test) and not type_checking:
            pending.extend(node.orelse)
        else:
            pending.extend(ast.iter_child_nodes(node))


def import_graph(
    files: dict[str, Path], sources: dict[str, str] | None = None, type_checking: bool = False
) -> dict[str, set[str]]:
    """Module -> the mie modules its source imports (``sources`` replaces a file's text). An
    import names the module itself: ``from mie.x import y`` imports ``mie.x.y`` if that is a
    module, else ``mie.x``; a package's own ``__init__``, which Python runs first, is not an
    edge (or every package whose ``__init__`` re-exports its modules would be a circle)."""
    sources = sources or {}

    def known_prefix(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        source = sources.get(module) or path.read_text(encoding="utf-8")
        package = module if path.stem == "__init__" else module.rpartition(".")[0]
        edges = graph.setdefault(module, set())
        for level, name, names in import_statements(source, path.suffix == ".pyx", type_checking):
            if level:
                base = package.split(".")[: len(package.split(".")) - level + 1]
                name = ".".join(filter(None, [*base, name]))
            if name != "mie" and not name.startswith("mie."):
                continue
            for target in [f"{name}.{n}" for n in names] or [name]:
                found = known_prefix(target)
                if found is not None and found != module:
                    edges.add(found)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A circle of imports in ``graph``, as [a, b, ..., a], or None (depth-first search)."""
    on_path, done = set(), set()
    for root in sorted(graph):
        if root in done:
            continue
        path, branches = [root], [iter(sorted(graph[root]))]
        on_path.add(root)
        while branches:
            nxt = next(branches[-1], None)
            if nxt is None:
                branches.pop()
                on_path.discard(path[-1])
                done.add(path.pop())
            elif nxt in on_path:
                return [*path[path.index(nxt) :], nxt]
            elif nxt not in done:
                path.append(nxt)
                on_path.add(nxt)
                branches.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_no_two_mie_modules_import_each_other():
    cycle = find_cycle(import_graph(module_files()))
    assert cycle is None, "an import circle: " + " -> ".join(cycle)


def test_a_function_level_import_that_closes_a_circle_is_caught():
    # the pool used to import the table inside new_table, while the table imported the pool
    files = module_files()
    table = files["mie.memory.table"].read_text(encoding="utf-8")
    table += "\n\ndef _pool():\n    from mie.memory.pool import BlockPool\n\n    return BlockPool\n"
    cycle = find_cycle(import_graph(files, {"mie.memory.table": table}))
    assert cycle is not None and {"mie.memory.pool", "mie.memory.table"} <= set(cycle), cycle


def test_type_checking_imports_are_what_keeps_pool_and_table_apart():
    # table.py names BlockPool in its annotations only: counted, that import closes a circle
    cycle = find_cycle(import_graph(module_files(), type_checking=True))
    assert cycle is not None and {"mie.memory.pool", "mie.memory.table"} <= set(cycle), cycle
