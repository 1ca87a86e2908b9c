"""Shared fixtures: run backend-independent tests once per backend (pure Python and Cython).

Where ``mie._fast`` is not built, the fast runs are skipped -- except under CI (the ``CI``
environment variable set), where CI builds the extension and a missing build is a failure, so
a broken build can never hide behind skips.
"""

import os

import pytest

from mie.backend import BACKENDS, Backend, fast_available, select

needs_fast = pytest.mark.skipif(
    not fast_available() and not os.environ.get("CI"),
    reason="mie._fast is not built (no C compiler at install time)",
)
"""Mark for test classes (hypothesis state machines): skip without the build, except in CI."""


def require_fast() -> None:
    """Skip the calling test when ``mie._fast`` is not built; fail instead under CI."""
    if fast_available():
        return
    if os.environ.get("CI"):
        pytest.fail("mie._fast is not built, but CI must test the fast backend")
    pytest.skip("mie._fast is not built (no C compiler at install time)")


def backend_named(name: str) -> Backend:
    if name == "fast":
        require_fast()
    return select(name)


@pytest.fixture(params=BACKENDS)
def backend(request) -> Backend:
    """Each backend in turn: tests written against ``backend.BlockPool`` etc. run on both."""
    return backend_named(request.param)
