"""The instruction-set choice of the compiled kernels (``mie._fast.isa.IsaChoice``), through the
API of both modules that make it: the matrix products (``mie._fast.linear``) and attention
(``mie._fast.ops``). That each forced variant really runs and matches the reference is
tested with the kernels, in test_fast_linear.py and test_fast_ops.py."""

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import require_fast

ROOT = Path(__file__).resolve().parent.parent
MODULES = ["mie._fast.linear", "mie._fast.ops"]


@pytest.fixture(params=MODULES)
def kernels(request):
    require_fast()
    return importlib.import_module(request.param)


def test_isa_list_and_default(kernels):
    assert kernels.ISAS[-1] == "generic"  # the portable fallback is always built
    assert set(kernels.supported_isas()) <= set(kernels.ISAS)
    assert "generic" in kernels.supported_isas()
    if not os.environ.get("MIE_ISA"):
        assert kernels.supported_isas()[0] == kernels.get_isa() == kernels.ISA  # the best
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    if " avx2 " in flags and " fma " in flags and "x86" in os.uname().machine:
        assert "avx2" in kernels.supported_isas()
    if " avx512bw " in flags and " avx512vl " in flags:
        assert "avx512" in kernels.supported_isas()


def test_set_isa_refuses_unknown_and_unsupported(kernels):
    before = kernels.ISA
    with pytest.raises(ValueError, match=r"unknown instruction set 'sse9': this build has"):
        kernels.set_isa("sse9")
    assert kernels.ISA == before
    try:  # a smaller CPU, simulated: the best variant becomes unsupported
        kernels._mask_isas([kernels.ISAS[0]])
        if kernels.ISAS[0] != "generic":
            assert kernels.ISA != kernels.ISAS[0] and kernels.ISA in kernels.supported_isas()
            with pytest.raises(ValueError, match=f"this CPU cannot run the '{kernels.ISAS[0]}'"):
                kernels.set_isa(kernels.ISAS[0])
    finally:
        kernels._mask_isas([])
        kernels.set_isa(before)


@pytest.mark.parametrize("module", MODULES)
def test_environment_variable_forces_a_variant(module):
    require_fast()

    def import_with(value: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", f"import {module} as m; print(m.ISA)"],
            env={**os.environ, "MIE_ISA": value},
            capture_output=True,
            text=True,
            cwd=ROOT,
        )

    done = import_with("generic")
    assert done.returncode == 0 and done.stdout.strip() == "generic", done.stderr
    done = import_with("nonsense")
    assert done.returncode != 0
    assert "MIE_ISA='nonsense': unknown instruction set 'nonsense'" in done.stderr


@pytest.mark.parametrize("variant, narrower", [("avx512vnni", "avx512"), ("avx2vnni", "avx2")])
def test_the_matrix_products_extra_variants_mean_the_set_they_extend_to_attention(
    variant, narrower
):
    """``MIE_ISA=avx512vnni`` or ``avx2vnni`` names a variant only ``mie._fast.linear`` has:
    both modules import, the attention kernels on ``avx512`` or ``avx2``."""
    require_fast()
    from mie._fast import linear

    if variant not in linear.supported_isas():
        pytest.skip(f"this machine cannot run {variant} (has {linear.supported_isas()})")
    program = "import mie._fast.ops as o, mie._fast.linear as l; print(o.ISA, l.ISA)"
    done = subprocess.run(
        [sys.executable, "-c", program],
        env={**os.environ, "MIE_ISA": variant},
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [narrower, variant]
