"""Every ``cuda/*.cu`` compiles with nvcc, without a single warning, for both target GPUs.

CI has the CUDA toolkit but no GPU, so this is where a kernel that does not build -- or builds
with a warning (an unused variable, a narrowing conversion, a register spill) -- is caught.
Targets: sm_87 (Jetson Orin) and sm_90 (H100/H200). Each file is compiled once per target, to
a cubin, so ptxas runs too; all compilations run in parallel.
"""

from __future__ import annotations

import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from mie.cuda.sources import KERNEL_FILES

NVCC = shutil.which("nvcc")
SOURCES = Path(__file__).resolve().parents[1] / "cuda"
ARCHITECTURES = ("sm_87", "sm_90")
STRICT = ["-Werror", "all-warnings", "-Xptxas", "-Werror,-warn-spills"]

pytestmark = pytest.mark.skipif(
    NVCC is None, reason="nvcc not on PATH: no CUDA toolkit, so the kernels cannot be compiled"
)


@pytest.fixture(scope="module")
def compilations(tmp_path_factory):
    """(file, arch) -> the finished nvcc run, all started at once."""
    out = tmp_path_factory.mktemp("cubin")

    def compile_one(job):
        name, arch = job
        command = [NVCC, f"-arch={arch}", "-cubin", *STRICT, "-o", str(out / f"{name}.{arch}")]
        command.append(str(SOURCES / f"{name}.cu"))
        return subprocess.run(command, capture_output=True, text=True)

    jobs = [(name, arch) for name in KERNEL_FILES for arch in ARCHITECTURES]
    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(zip(jobs, pool.map(compile_one, jobs), strict=True)), out


def test_every_source_is_listed():
    """A new .cu file must join KERNEL_FILES, or it would be neither compiled here nor loaded."""
    assert sorted(p.stem for p in SOURCES.glob("*.cu")) == sorted(KERNEL_FILES)


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("name", KERNEL_FILES)
def test_kernel_compiles_without_warnings(compilations, name, arch):
    results, out = compilations
    result = results[(name, arch)]
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout + result.stderr == ""  # not even a note
    assert (out / f"{name}.{arch}").stat().st_size > 0
