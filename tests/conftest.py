"""Shared test setup: hypothesis profiles, tests once per backend, optional packages.

**Hypothesis profiles.** With the ``CI`` environment variable set (``.ci/run`` sets it), the
``ci`` profile is loaded: ``derandomize=True`` (every run of a test tries the same examples, so a
landing never depends on luck), ``database=None`` (a failing example saved in ``.hypothesis/``
by an earlier run in the same clone is never replayed, so it cannot fail CI either),
``print_blob=True`` (a failure prints the line that reproduces it), ``deadline=None`` (timing on
a loaded two-core machine is no test) and the ``too_slow`` health check off for the same
reason. Elsewhere the ``dev`` profile: randomized, with hypothesis' default example database,
so local runs keep exploring new examples and replay the failures they found.
``pytest --hypothesis-profile=ci`` runs the CI profile locally.

Tests set their own ``@settings(max_examples=..., deadline=None, ...)`` and inherit the rest
from the loaded profile; none may pass ``derandomize`` or ``database`` (that would override the
profile; ``tests/test_ci_profile.py`` checks the suite for it).

**Both backends.** Backend-independent tests run once per backend (pure Python and Cython).
Where ``mie._fast`` is not built the fast runs are skipped with the reason
(``mie.extension.fast_unavailable_reason``: not built, broken, or shadowed) -- except under CI,
where CI builds the extension and a missing build is a failure, so a broken build can never
hide behind skips.

**Optional packages.** The core suite (memory, scheduler, ops, fast) needs numpy and
hypothesis alone. Test modules that need torch, transformers, safetensors or the server stack
get them through ``require_module``: skipped, naming what is missing, where it is not
installed -- except under CI, where the import fails, so CI never silently loses them.
"""

import functools
import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import HealthCheck, settings

from mie.backend import Backend, select
from mie.extension import BACKENDS, fast_available, fast_unavailable_reason

# Both from hypothesis' "default" profile, stated in full: recent hypothesis versions load a
# built-in "ci" profile of their own when CI is set, and a profile registered without a parent
# would inherit whatever that version's one holds.
settings.register_profile(
    "ci",
    settings.get_profile("default"),
    derandomize=True,
    database=None,
    print_blob=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", settings.get_profile("default"), derandomize=False, deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")

needs_fast = pytest.mark.skipif(
    not fast_available() and not os.environ.get("CI"),
    reason=fast_unavailable_reason() or "mie._fast is built",
)
"""Mark for test classes (hypothesis state machines): skip without the build, except in CI."""


def require_fast() -> None:
    """Skip the calling test when ``mie._fast`` does not import, saying why; fail under CI."""
    reason = fast_unavailable_reason()
    if reason is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"CI must test the fast backend, but {reason}")
    pytest.skip(reason)


def require_module(name: str) -> ModuleType:
    """Import ``name`` for a test module that needs it (torch, transformers, the server stack).

    Locally, where ``name`` or a package it imports is not installed, the calling test module
    is skipped, naming what is missing: the core suite (memory, scheduler, ops, fast) runs with
    numpy and hypothesis alone. Under CI, which installs the test extras, the import error is
    raised instead, so a missing package fails the run rather than silently dropping the tests
    that need it. A missing *mie* module is never a reason to skip: that is a bug.

    Call it after the module's imports (``torch = require_module("torch")``), so everything
    the core suite needs is imported normally.
    """
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        missing = (error.name or "").partition(".")[0]
        if os.environ.get("CI") or not missing or missing == "mie":
            raise
        needs = missing if name == missing else f"{missing} (for {name})"
        reason = f"needs {needs}, not installed: pip install -e '.[test]'"
        pytest.skip(reason, allow_module_level=True)


def backend_named(name: str) -> Backend:
    if name == "fast":
        require_fast()
    return select(name)


STORIES = Path(__file__).resolve().parents[1] / "models" / "stories260K"


def load_script(name: str) -> ModuleType:
    """``scripts/<name>.py`` as a module (the scripts are not a package), registered in
    ``sys.modules`` under ``name``, where dataclasses defined in it look their module up."""
    spec = importlib.util.spec_from_file_location(
        name, STORIES.parents[1] / "scripts" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# The skip reasons of the opt-in llama.cpp tests (the peers extra; llama.cpp's converter).
LLAMA_CPP_MISSING = (
    'needs llama-cpp-python, the opt-in peers extra (compiles llama.cpp): pip install -e ".[peers]"'
)
CONVERTER_MISSING = (
    "needs llama.cpp's convert_hf_to_gguf.py, which llama-cpp-python's wheel does not ship: set "
    "LLAMA_CPP_SOURCE to a llama.cpp checkout or to llama-cpp-python's source distribution "
    "(pip download llama-cpp-python==VERSION --no-deps --no-binary :all:)"
)


@functools.cache
def stories_tokenizer():
    """stories260K's tokenizer, loaded once per session."""
    from mie.engine.tokenizer import Tokenizer

    return Tokenizer(STORIES)


def stories_with_window(directory: Path, window: int) -> Path:
    """A copy of stories260K in ``directory`` as a Mistral with a sliding window of
    ``window`` tokens: a windowed model with a real tokenizer and trained weights."""
    copy = directory / f"stories260K-window{window}"
    shutil.copytree(STORIES, copy)
    config = json.loads((copy / "config.json").read_text())
    config.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=window)
    (copy / "config.json").write_text(json.dumps(config))
    return copy


def engine_of(model, backend_name: str = "python", **settings):
    """An ``LLMEngine`` over a built ``model`` (with ``backend_name``'s kernels) and
    stories260K's tokenizer; 64 KV blocks unless ``settings`` say otherwise."""
    from mie.engine.llm_engine import LLMEngine

    settings.setdefault("num_blocks", 64)
    return LLMEngine(
        model, backend=backend_named(backend_name), tokenizer=stories_tokenizer(), **settings
    )


def assert_drained(engine) -> None:
    """No request left and every block back in the pool (or idle in the prefix cache, which
    is then cleared and checked empty too)."""
    assert not engine.has_unfinished_requests()
    engine.scheduler.check_integrity()
    cache = engine.scheduler.prefix_cache
    idle = cache.num_evictable if cache is not None else 0
    assert engine.pool.num_free + idle == engine.pool.num_blocks, "a block leaked"
    if cache is not None:
        engine.scheduler.clear_prefix_cache()
        assert engine.pool.num_free == engine.pool.num_blocks


@pytest.fixture(params=BACKENDS)
def backend(request) -> Backend:
    """Each backend in turn: tests written against ``backend.BlockPool`` etc. run on both."""
    return backend_named(request.param)


def run_to_completion(engine) -> dict:
    """Step an ``LLMEngine`` until it has no request left; request id -> its final output."""
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def run_through_failures(engine) -> tuple[dict, int]:
    """``run_to_completion`` for an engine whose steps may fail (injected faults): each
    ``StepError`` is counted and the engine stepped on. (final outputs, failed steps)."""
    from mie.engine.llm_engine import StepError

    done, failures = {}, 0
    while engine.has_unfinished_requests():
        try:
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
        except StepError:
            failures += 1
    return done, failures


ALL_ISAS = ("avx512", "avx2", "generic")
LINEAR_ISAS = ("avx512vnni", "avx512", "avx2vnni", "avx2", "generic")
"""The matrix products' variants: the attention kernels' (``ALL_ISAS``) and two more, AVX-512
and AVX2 with VNNI."""


def force_isa(module, isa: str):
    """The body of an ``isa`` fixture: ``module`` (``mie._fast.ops`` or ``mie._fast.linear``)
    forced to ``isa`` for one test and restored after; skipped where this build or CPU lacks
    it."""
    if isa not in module.supported_isas():
        pytest.skip(f"this machine cannot run {isa} (has {module.supported_isas()})")
    before = module.ISA
    module.set_isa(isa)
    yield isa
    module.set_isa(before)


@pytest.fixture(scope="module")
def fast():
    """The compiled kernels package (``mie._fast``), or a skip (a failure under CI)."""
    require_fast()
    import mie._fast

    return mie._fast


@pytest.fixture(params=ALL_ISAS)
def isa(request, fast):
    """The Cython attention kernels (``mie._fast.ops``) forced to each instruction set in
    turn; skipped where this build or CPU lacks it. (tests/test_fast_linear.py has its own,
    for the matrix products.)"""
    yield from force_isa(sys.modules["mie._fast.ops"], request.param)


def compiled_kernel_variants(tmp_path, program: str, generic_only: bool) -> list[str]:
    """Compile a C ``program`` against the kernel headers in ``mie/_fast`` warning-free (with
    ``MIE_GENERIC_ONLY`` if asked: what a non-x86 machine compiles), run it, and return the
    words it printed: the variants it ran. Skips without a C compiler; fails if the program
    returns non-zero."""
    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        pytest.skip("no C compiler")
    source = tmp_path / "program.c"
    source.write_text(program)
    headers = Path(__file__).resolve().parent.parent / "mie" / "_fast"
    flags = ["-DMIE_GENERIC_ONLY"] if generic_only else []
    binary = tmp_path / "program"
    warnings = ["-Wall", "-Wextra", "-Werror", "-Wno-unknown-pragmas", "-Wno-unused-function"]
    command = [compiler, "-O1", *warnings, *flags, f"-I{headers}", str(source), "-o", str(binary)]
    subprocess.run([*command, "-lm"], check=True)
    done = subprocess.run([str(binary)], capture_output=True, text=True)
    assert done.returncode == 0, done.returncode
    return done.stdout.split()
