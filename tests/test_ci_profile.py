"""The hypothesis profiles of tests/conftest.py: CI is reproducible and ignores saved failures.

The profile is chosen when conftest.py is imported, so each case runs in a fresh interpreter
with ``CI`` set or unset, whatever the environment of this run.
"""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

# Imports conftest (which loads the profile), then runs one property twice and prints what it
# saw: the active settings, the settings of a test that sets only max_examples, and whether
# the two runs drew the same examples.
PROBE = textwrap.dedent(
    """
    import conftest
    from hypothesis import given, settings, strategies as st

    seen = []
    own = settings(max_examples=20)  # what a test's @settings(max_examples=...) builds

    @own
    @given(st.integers())
    def probe(x):
        seen.append(x)

    probe()
    first = list(seen)
    seen.clear()
    probe()
    active = settings()
    print(active._current_profile, active.derandomize, type(active.database).__name__,
          active.print_blob, active.deadline, own.derandomize, type(own.database).__name__,
          own.max_examples, seen == first)
    """
)


# A property that fails on every x > 1000 ("plant": hypothesis shrinks that to 1001 and, with a
# database, saves it), or only on x == 1001 ("check": found by replaying the saved example, or
# by luck). The function's text is the same in both modes, so both share the database key.
REPLAY = textwrap.dedent(
    """
    import sys
    import conftest
    from hypothesis import given, settings, strategies as st

    @settings(max_examples=50)
    @given(st.integers())
    def property(x):
        assert x <= 1000 if sys.argv[1] == "plant" else x != 1001

    try:
        property()
    except AssertionError:
        print("failed")
    else:
        print("passed")
    """
)


def run_python(tmp_path: Path, ci: str | None, script: str, *args: str) -> list[str]:
    """Run ``script`` in a fresh interpreter in ``tmp_path``, with ``CI`` set to ``ci``."""
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    return run.stdout.split()


def probe(tmp_path: Path, ci: str | None) -> list[str]:
    return run_python(tmp_path, ci, PROBE)


@pytest.mark.parametrize("ci", ["1", "true"])
def test_ci_profile_is_derandomized_without_a_database(tmp_path, ci):
    profile, derandomize, database, blob, deadline, own_derandomize, own_database, *rest = probe(
        tmp_path, ci
    )
    assert (profile, derandomize, database, blob, deadline) == (
        "ci",
        "True",
        "NoneType",
        "True",
        "None",
    )
    # a test that sets max_examples keeps the profile's derandomize and (no) database
    assert (own_derandomize, own_database) == ("True", "NoneType")
    assert rest == ["20", "True"]  # two runs, the same examples: reproducible


def test_dev_profile_is_randomized_with_the_default_database(tmp_path):
    profile, derandomize, database, blob, deadline, own_derandomize, own_database, *rest = probe(
        tmp_path, None
    )
    assert (profile, derandomize, deadline, own_derandomize) == ("dev", "False", "None", "False")
    assert database != "NoneType" and own_database != "NoneType"  # failures are replayed locally
    assert rest == ["20", "False"]  # new examples each run


def test_a_failure_saved_in_the_clone_fails_dev_runs_but_not_ci(tmp_path):
    """A failing example saved in .hypothesis/ keeps failing every rerun in
    that clone. Locally that is the point (the failure is replayed until fixed); under CI it
    would make a landing depend on what an earlier run happened to find."""
    assert run_python(tmp_path, None, REPLAY, "plant") == ["failed"]  # saves x = 1001
    assert (tmp_path / ".hypothesis" / "examples").is_dir()
    assert run_python(tmp_path, None, REPLAY, "check") == ["failed"]  # replayed: found again
    assert run_python(tmp_path, "1", REPLAY, "check") == ["passed"]  # CI never reads it
    assert run_python(tmp_path, "1", REPLAY, "check") == ["passed"]  # ... on every rerun


def test_no_test_overrides_the_profiles_derandomize_or_database():
    """A test passing ``derandomize=`` or ``database=`` itself would escape the CI profile."""
    offenders = [
        f"{path.name}:{number}"
        for path in sorted(TESTS.glob("*.py"))
        if path.name not in ("conftest.py", Path(__file__).name)
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if re.search(r"\b(derandomize|database)\s*=", line)
    ]
    assert offenders == []
