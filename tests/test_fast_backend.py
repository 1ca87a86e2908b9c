"""Backend selection: explicit name, then MIE_BACKEND, then whatever is built; and the
diagnosis of a fast backend that does not import (not built, broken, or shadowed)."""

import importlib
import importlib.machinery
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import require_fast

import mie
import mie.extension
from mie import memory, ops, scheduler
from mie.backend import select
from mie.extension import (
    BackendUnavailableError,
    explain_missing_build,
    fast_available,
    fast_unavailable_reason,
)

SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]  # e.g. .cpython-311-x86_64-linux-gnu.so


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv("MIE_BACKEND", raising=False)


@pytest.fixture
def unbuilt(monkeypatch, tmp_path):
    """Make ``mie._fast`` look as if setup.py had found no compiler: its import fails, and the
    diagnosis sees a ``mie`` package without compiled modules and no build on the path."""
    monkeypatch.delitem(sys.modules, "mie._fast", raising=False)
    for name in mie.extension.FAST_MODULES:
        monkeypatch.setitem(sys.modules, name, None)  # its import now fails
    package = tmp_path / "source" / "mie"
    (package / "_fast").mkdir(parents=True)
    monkeypatch.setattr(mie.extension, "PACKAGE_DIR", package)
    monkeypatch.setattr(sys, "path", [str(tmp_path / "empty")])


def test_the_fast_backend_is_built_or_the_reason_is_given():
    """Runs wherever the extension is built; elsewhere it skips with the diagnosis itself as
    the reason (not built, broken, shadowed), except under CI, which must build it."""
    reason = fast_unavailable_reason()
    if reason is not None:
        assert not fast_available()
        if os.environ.get("CI"):
            pytest.fail(f"CI must build the fast backend, but {reason}")
        pytest.skip(reason)
    assert fast_available()
    import mie._fast

    # built where the imported package is: not shadowed by another mie on the path
    assert Path(mie._fast.__file__).parent == Path(mie.__file__).parent / "_fast"
    assert list(Path(mie._fast.__file__).parent.glob("memory*" + SUFFIX))


def test_python_backend_is_the_reference(no_env):
    python = select("python")
    assert python.name == "python"
    assert python.BlockPool is memory.BlockPool and python.BlockTable is memory.BlockTable
    assert python.kernels.paged_attention is ops.paged_attention
    assert python.kernels.prefill_attention is ops.prefill_attention
    assert python.kernels.reshape_and_cache is ops.reshape_and_cache
    assert python.Scheduler is scheduler.Scheduler


def test_fast_backend_is_the_extension(no_env):
    require_fast()
    import mie._fast

    fast = select("fast")
    assert fast.name == "fast"
    assert fast.BlockPool is mie._fast.BlockPool and fast.BlockTable is mie._fast.BlockTable
    assert fast.kernels.paged_attention is mie._fast.paged_attention
    assert fast.Scheduler is mie._fast.Scheduler


def test_default_is_fast_when_built(no_env):
    require_fast()
    assert select().name == select(None).name == "fast"


def test_environment_variable_then_argument(monkeypatch):
    require_fast()
    monkeypatch.setenv("MIE_BACKEND", "python")
    assert select().name == "python"
    assert select("fast").name == "fast"  # the argument wins over the environment
    monkeypatch.setenv("MIE_BACKEND", "fast")
    assert select().name == "fast"
    assert select("python").name == "python"


def test_empty_environment_variable_means_unset(monkeypatch):
    monkeypatch.setenv("MIE_BACKEND", "")
    assert select().name == ("fast" if fast_available() else "python")


@pytest.mark.parametrize("name", ["cython", "Fast", ""])
def test_unknown_name_is_a_value_error(no_env, name):
    with pytest.raises(ValueError, match="unknown backend"):
        select(name)


def test_unknown_environment_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("MIE_BACKEND", "gpu")
    with pytest.raises(ValueError, match="'gpu'.*MIE_BACKEND"):
        select()


def test_unbuilt_extension_falls_back_to_python(no_env, unbuilt):
    assert not fast_available()
    assert select().name == "python"


def test_asking_for_fast_when_unbuilt_says_why_and_how_to_build(no_env, unbuilt, monkeypatch):
    with pytest.raises(BackendUnavailableError, match="not built.*pip install -e ."):
        select("fast")
    monkeypatch.setenv("MIE_BACKEND", "fast")
    with pytest.raises(BackendUnavailableError, match="MIE_BACKEND=python"):
        select()
    assert "not built" in fast_unavailable_reason()


def test_importing_the_unbuilt_package_says_it_is_not_built(unbuilt):
    with pytest.raises(ImportError, match="not built.*pip install -e ."):
        importlib.import_module("mie._fast")


# -- the diagnosis, on made-up layouts ---------------------------------------------------------
def fake_tree(root: Path, *files: str) -> Path:
    """A folder holding a ``mie`` package with a ``_fast`` folder and the given files in it."""
    fast_dir = root / "mie" / "_fast"
    fast_dir.mkdir(parents=True)
    (fast_dir / "__init__.py").write_text("")
    for name in files:
        (fast_dir / name).write_bytes(b"\x7fELF")
    return root


@pytest.fixture
def compiler(monkeypatch):
    """Pretend a C compiler is (``compiler("/usr/bin/cc")``) or is not (``None``) on PATH."""
    return lambda path: monkeypatch.setattr(mie.extension, "_c_compiler", lambda: path)


MISSING = ModuleNotFoundError("No module named 'mie._fast.memory'", name="mie._fast.memory")


@pytest.mark.parametrize("name", [f"memory{SUFFIX}", "x.so"])
def test_a_build_elsewhere_on_the_path_is_reported_as_shadowed(tmp_path, name):
    """``pip install .`` built into site-packages, ``python -m`` run from the
    clone's root imports the clone's mie/ first, which has no compiled modules."""
    clone = fake_tree(tmp_path / "clone")
    (clone / "setup.py").write_text("")
    site = fake_tree(tmp_path / "site-packages", name)
    text = explain_missing_build(MISSING, clone / "mie", [str(clone), str(site)])
    assert "not built" not in text
    assert f"built in {site / 'mie' / '_fast'}" in text  # where the build is
    assert f"imports mie from {clone / 'mie'}" in text  # what hides it
    assert "hides" in text and f"cd {clone} && python -m pip install -e ." in text  # the fix


def test_the_first_build_on_the_path_is_the_one_named(tmp_path):
    clone = fake_tree(tmp_path / "clone")
    first, second = (fake_tree(tmp_path / name, "ops.so") for name in ("first", "second"))
    text = explain_missing_build(MISSING, clone / "mie", [str(clone), str(first), str(second)])
    assert str(first / "mie" / "_fast") in text and str(second) not in text


def test_no_build_anywhere_is_not_built_with_the_error_and_the_fix(tmp_path, compiler):
    compiler("/usr/bin/cc")
    clone = fake_tree(tmp_path / "clone", "memory.c", "memory.pyx")  # sources, no modules
    (clone / "setup.py").write_text("")
    other = fake_tree(tmp_path / "other", "ops.pyx")
    text = explain_missing_build(MISSING, clone / "mie", [str(clone), str(other)])
    assert text.startswith("mie._fast is not built: there are no compiled modules in ")
    assert "ModuleNotFoundError: No module named 'mie._fast.memory'" in text  # why
    assert "(/usr/bin/cc)" in text and f"cd {clone} && python -m pip install -e ." in text


def test_without_a_compiler_the_diagnosis_says_to_install_one(tmp_path, compiler):
    compiler(None)
    clone = fake_tree(tmp_path / "clone")
    text = explain_missing_build(MISSING, clone / "mie", [str(clone)])
    assert "not built" in text and "no C compiler was found" in text
    # not from a source tree (an installed mie without its build): no made-up path to cd into
    assert "cd " not in text and "from mie's source tree" in text


def test_modules_built_for_another_python_are_named(tmp_path, compiler):
    compiler("/usr/bin/cc")
    clone = fake_tree(tmp_path / "clone", "memory.cpython-29-x86_64-linux-gnu.so")
    text = explain_missing_build(MISSING, clone / "mie", [str(clone)])
    assert "not built" in text and "another Python (memory.cpython-29" in text


def test_modules_that_are_there_but_fail_to_import_are_reported_broken(tmp_path):
    clone = fake_tree(tmp_path / "clone", f"memory{SUFFIX}")
    site = fake_tree(tmp_path / "site", f"memory{SUFFIX}")
    error = ImportError("numpy.core.multiarray failed to import")
    text = explain_missing_build(error, clone / "mie", [str(clone), str(site)])
    assert f"built in {clone / 'mie' / '_fast'} but does not import" in text
    assert "numpy.core.multiarray failed to import" in text and "pip install -e ." in text


def test_unreadable_and_odd_path_entries_are_skipped(tmp_path, compiler):
    compiler("/usr/bin/cc")
    clone = fake_tree(tmp_path / "clone")
    (tmp_path / "file").write_text("")  # a path entry that is a file (a zip, say)
    path = [str(clone), str(tmp_path / "file"), str(tmp_path / "missing"), b"bytes", "x.zip"]
    assert "not built" in explain_missing_build(MISSING, clone / "mie", path)


def test_a_shadowed_build_in_a_real_interpreter(tmp_path):
    """End to end: a copy of the source package with no compiled
    modules in the current directory, the real build later on the path. The reason, the
    ``backend="fast"`` error and ``python -m mie.bench --backend fast`` all say it is shadowed."""
    require_fast()
    real_root = Path(mie.__file__).parent.parent
    shutil.copytree(
        real_root / "mie", tmp_path / "mie", ignore=shutil.ignore_patterns("*.so", "*.c", "*.html")
    )
    env = {**os.environ, "PYTHONPATH": str(real_root)}
    env.pop("MIE_BACKEND", None)
    script = (
        "import mie, mie.backend as b, mie.extension as x\n"
        "print(mie.__file__)\n"
        "print(x.fast_unavailable_reason())\n"
        "print(b.select().name)\n"
        "try:\n    b.select('fast')\nexcept x.BackendUnavailableError as e:\n    print(e)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    imported, reason, default, error = run.stdout.splitlines()
    assert imported == str(tmp_path / "mie" / "__init__.py")  # the copy shadows the real one
    assert f"built in {real_root / 'mie' / '_fast'}" in reason and "hides" in reason
    assert default == "python" and "hides" in error and "MIE_BACKEND=python" in error
    bench = subprocess.run(
        [sys.executable, "-m", "mie.bench", "--backend", "fast", "--only", "mechanisms"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert bench.returncode == 2 and bench.stdout == ""
    assert bench.stderr.startswith("python -m mie.bench: error: ") and "hides" in bench.stderr


@pytest.mark.parametrize(
    "user_env, spin",
    [
        ({}, "3000"),  # mie's default: spin a little, then sleep
        ({"OMP_WAIT_POLICY": "ACTIVE"}, "30000000000"),  # the user's choices win
        ({"GOMP_SPINCOUNT": "42"}, "42"),
    ],
)
def test_openmp_threads_spin_briefly_and_the_environment_is_left_alone(user_env, spin):
    """mie's OpenMP runtime starts with GOMP_SPINCOUNT = mie._fast.SPIN_COUNT unless the user
    set OMP_WAIT_POLICY or GOMP_SPINCOUNT, and the process environment is as it was
    afterwards. libgomp prints the spin count it read when it loaded (OMP_DISPLAY_ENV=VERBOSE),
    so this sees what the runtime really got."""
    require_fast()
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env |= {"OMP_DISPLAY_ENV": "VERBOSE", **user_env}
    script = "import os, mie._fast\nprint('after:', os.environ.get('GOMP_SPINCOUNT'))"
    run = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    )
    assert f"GOMP_SPINCOUNT = '{spin}'" in run.stderr + run.stdout
    assert f"after: {user_env.get('GOMP_SPINCOUNT')}" in run.stdout
