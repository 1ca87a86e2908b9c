"""Backend selection: explicit name, then MIE_BACKEND, then whatever is built."""

import importlib
import os
import sys

import pytest
from conftest import require_fast

from mie import memory, ops, scheduler
from mie.backend import BackendUnavailableError, fast_available, select


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv("MIE_BACKEND", raising=False)


@pytest.fixture
def unbuilt(monkeypatch):
    """Make ``mie._fast`` look as if setup.py had found no compiler."""
    monkeypatch.delitem(sys.modules, "mie._fast", raising=False)
    monkeypatch.delitem(sys.modules, "mie._fast.memory", raising=False)
    monkeypatch.setitem(sys.modules, "mie._fast.memory", None)  # import now fails


@pytest.mark.skipif(not os.environ.get("CI"), reason="only CI guarantees a compiler")
def test_ci_builds_the_fast_backend():
    assert fast_available()


def test_python_backend_is_the_reference(no_env):
    python = select("python")
    assert python.name == "python"
    assert python.BlockPool is memory.BlockPool and python.BlockTable is memory.BlockTable
    assert python.paged_attention is ops.paged_attention
    assert python.prefill_attention is ops.prefill_attention
    assert python.reshape_and_cache is ops.reshape_and_cache
    assert python.Scheduler is scheduler.Scheduler


def test_fast_backend_is_the_extension(no_env):
    require_fast()
    import mie._fast

    fast = select("fast")
    assert fast.name == "fast"
    assert fast.BlockPool is mie._fast.BlockPool and fast.BlockTable is mie._fast.BlockTable
    assert fast.paged_attention is mie._fast.paged_attention
    assert fast.Scheduler is mie._fast.Scheduler
    assert mie._fast.AllocatorError is memory.AllocatorError


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


def test_asking_for_fast_when_unbuilt_says_how_to_build(no_env, unbuilt, monkeypatch):
    with pytest.raises(BackendUnavailableError, match="pip install"):
        select("fast")
    monkeypatch.setenv("MIE_BACKEND", "fast")
    with pytest.raises(BackendUnavailableError, match="MIE_BACKEND=python"):
        select()


def test_importing_the_unbuilt_package_says_it_is_not_built(unbuilt):
    with pytest.raises(ImportError, match="not built"):
        importlib.import_module("mie._fast")
