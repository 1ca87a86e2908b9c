"""Run mie's CUDA kernels on the CPU: a test-only ``CudaDevice`` built on ``cuda_emulator.hpp``.

CI has no GPU, yet the kernels' index math, their synchronisation structure and the Python
wrappers' launch arguments are what most often goes wrong. This backend compiles each
``cuda/*.cu`` file *unchanged* as C++ (two textual substitutions turn ``__shared__`` arrays
into memory shared by the emulated threads) with g++, generates one ``extern "C"`` launcher per
kernel, and calls it through ctypes, one OS thread per CUDA thread. It also checks every
launch argument against the C type of its kernel parameter -- a mismatch (say ``np.int64`` for
an ``int``) would silently scramble the arguments on a real GPU.

"Device" arrays are ``EmulatedArray``s (host memory tagged as device memory), so the wrappers'
host-to-device paths run exactly as on a GPU. Fresh device arrays are filled with NaN, and
shared memory is poisoned with NaN before each thread block, so a read of something never
written shows up in the result.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import hashlib
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from mie.cuda.device import CudaDevice, Dim3

HEADER = Path(__file__).with_name("cuda_emulator.hpp")
COMPILER = shutil.which("g++")

SCALAR_TYPES = {
    "int": (np.int32, ctypes.c_int32),
    "long long": (np.int64, ctypes.c_int64),
    "float": (np.float32, ctypes.c_float),
    "double": (np.float64, ctypes.c_double),
}
KERNEL = re.compile(
    r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)\s*\(([^)]*)\)'
)
DYNAMIC_SHARED = re.compile(r"extern\s+__shared__\s+(?:__align__\(\d+\)\s+)?(\w+)\s+(\w+)\[\];")


class EmulatedArray(np.ndarray):
    """Host memory standing in for device memory."""


class Parameter:
    """One kernel parameter: a pointer, or a scalar of one of SCALAR_TYPES."""

    def __init__(self, declaration: str) -> None:
        words = declaration.replace("*", " * ").split()
        self.name = words[-1]
        self.is_pointer = "*" in words
        self.c_type = " ".join(w for w in words[:-1] if w not in ("const", "__restrict__", "*"))
        if not self.is_pointer and self.c_type not in SCALAR_TYPES:
            raise TypeError(f"the emulator does not know the C type {self.c_type!r}")

    def convert(self, value: Any) -> Any:
        if self.is_pointer:
            if type(value) is not np.uint64:
                raise TypeError(f"kernel parameter {self.name} is a pointer, got {value!r}")
            return ctypes.c_void_p(int(value))
        numpy_type, c_type = SCALAR_TYPES[self.c_type]
        if type(value) is not numpy_type:
            raise TypeError(
                f"kernel parameter {self.name} is a C {self.c_type}, so it must be passed as "
                f"{numpy_type.__name__}, got {type(value).__name__}"
            )
        return c_type(value)

    def argtype(self) -> Any:
        return ctypes.c_void_p if self.is_pointer else SCALAR_TYPES[self.c_type][1]


def kernels_of(code: str) -> dict[str, tuple[str, list[Parameter]]]:
    """Each kernel of a .cu text: name -> (parameter list text, parsed parameters)."""
    code = re.sub(r"//[^\n]*", "", code)
    found = {}
    for name, params in KERNEL.findall(code):
        found[name] = (params, [Parameter(p) for p in params.split(",")])
    return found


def translate(code: str) -> str:
    """The .cu text as C++ for the emulator: shared arrays become memory all threads see."""
    code = DYNAMIC_SHARED.sub(r"\1* \2 = reinterpret_cast<\1*>(emu::shared_memory);", code)
    code = code.replace("__shared__", "static")
    launchers = [
        f'extern "C" void emu_launch_{name}(unsigned gx, unsigned gy, unsigned gz, unsigned bx, '
        f"unsigned by, unsigned bz, std::size_t shared, {params}) {{\n"
        f"    emu::launch({{gx, gy, gz}}, {{bx, by, bz}}, shared, [&] {{ "
        f"{name}({', '.join(p.name for p in parsed)}); }});\n}}\n"
        for name, (params, parsed) in kernels_of(code).items()
    ]
    return code + "\n" + "\n".join(launchers)


@functools.cache
def _build_dir() -> Path:
    """One folder of compiled kernels per test process, shared by every EmulatorDevice."""
    folder = Path(tempfile.mkdtemp(prefix="mie-cuda-emulator-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


class EmulatorDevice(CudaDevice):
    """The kernels compiled with g++ and run on CPU threads (see the module docstring)."""

    name = "emulator"
    device_name = "CPU emulator"
    peak_bandwidth = None

    def __init__(self, multiprocessor_count: int = 2) -> None:
        super().__init__()
        if COMPILER is None:
            raise RuntimeError("the CUDA emulator needs g++")
        self.multiprocessor_count = multiprocessor_count

    def _compile(self, code: str) -> Any:
        source = translate(code)
        digest = hashlib.sha256((HEADER.read_text() + source).encode()).hexdigest()[:16]
        library = _build_dir() / f"kernels_{digest}.so"
        if not library.exists():
            command = [
                COMPILER,
                "-std=c++20",
                "-O1",
                "-Wall",
                "-Werror",
                "-Wno-unknown-pragmas",
                "-shared",
                "-fPIC",
            ]
            command += ["-pthread", "-include", str(HEADER), "-x", "c++", "-", "-o", str(library)]
            result = subprocess.run(command, input=source, text=True, capture_output=True)
            if result.returncode:
                raise RuntimeError(f"g++ could not compile the kernels:\n{result.stderr}")
        return ctypes.CDLL(str(library)), kernels_of(code)

    def _get_function(self, module: Any, name: str) -> Any:
        library, kernels = module
        parameters = kernels[name][1]
        function = getattr(library, f"emu_launch_{name}")
        function.argtypes = [ctypes.c_uint] * 6 + [ctypes.c_size_t]
        function.argtypes += [p.argtype() for p in parameters]
        function.restype = None
        return function, parameters

    def _launch(
        self, function: Any, grid: Dim3, block: Dim3, args: list[Any], shared_bytes: int
    ) -> None:
        launcher, parameters = function
        if len(args) != len(parameters):
            raise TypeError(f"{len(parameters)} kernel parameters, {len(args)} arguments")
        if min(grid) < 1 or min(block) < 1:
            raise ValueError(f"empty launch: grid {grid}, block {block}")
        values = [p.convert(a) for p, a in zip(parameters, args, strict=True)]
        launcher(*grid, *block, shared_bytes, *values)

    def is_device_array(self, a: Any) -> bool:
        return isinstance(a, EmulatedArray)

    def pointer(self, a: Any) -> int:
        return a.ctypes.data

    def to_device(self, a: np.ndarray) -> Any:
        return np.array(a, order="C").view(EmulatedArray)

    def to_host(self, a: Any) -> np.ndarray:
        return np.array(a.view(np.ndarray))

    def empty(self, shape: tuple[int, ...], dtype: Any) -> Any:
        fill = np.nan if np.dtype(dtype).kind == "f" else -1
        return np.full(shape, fill, dtype=dtype).view(EmulatedArray)

    def elapsed_ms(self, run: Callable[[], None], repeats: int) -> float:
        start = time.perf_counter()
        for _ in range(repeats):
            run()
        return (time.perf_counter() - start) * 1e3 / repeats
