"""A CUDA device, reached through pycuda or CuPy: compiling and launching ``cuda/*.cu``.

The ``.cu`` files are plain CUDA C++ with ``extern "C"`` kernels and no ``#include``, so the
same text compiles with nvcc (pycuda's ``SourceModule``) and with NVRTC (CuPy's
``RawModule``). A ``CudaDevice`` hides which of the two is in use: it compiles a source file
once, launches a kernel by name with device arrays and NumPy scalars as arguments, and moves
arrays between host and device. ``mie.cuda.ops`` is written against this interface only.
``get_device()`` loads the one device this process uses, on first call: pycuda if it is
installed, else CuPy; nothing GPU-related is imported before that.

(Not to be confused with ``mie.backend.Backend``, the engine's choice between the Python
reference and the Cython mirrors on the CPU: no engine path runs on a CUDA device yet.)

Kernel arguments cross the boundary as NumPy scalars whose dtype is the C type of the
parameter (``np.int32`` for ``int``, ``np.int64`` for ``long long``, ``np.float32`` for
``float``, ``np.float64`` for ``double``); device arrays become their address (``np.uint64``).
"""

from __future__ import annotations

import importlib.util
import shutil
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from mie.cuda.sources import kernel_source

Dim3 = tuple[int, int, int]


class CudaDevice(ABC):
    """A CUDA device reached through one Python library (or, in tests, a CPU emulator)."""

    name: str
    device_name: str
    multiprocessor_count: int
    peak_bandwidth: float | None  # bytes/s from the memory clock and bus width, if reported

    def __init__(self) -> None:
        self._modules: dict[str, Any] = {}
        self._functions: dict[tuple[str, str], Any] = {}

    def launch(
        self,
        source: str,
        kernel: str,
        grid: Dim3,
        block: Dim3,
        args: Sequence[Any],
        shared_bytes: int = 0,
    ) -> None:
        """Run ``kernel`` of ``cuda/<source>.cu``; device arrays in ``args`` pass as pointers."""
        key = (source, kernel)
        if key not in self._functions:
            if source not in self._modules:
                self._modules[source] = self._compile(kernel_source(source))
            self._functions[key] = self._get_function(self._modules[source], kernel)
        values = [np.uint64(self.pointer(a)) if self.is_device_array(a) else a for a in args]
        self._launch(self._functions[key], grid, block, values, shared_bytes)

    @abstractmethod
    def _compile(self, code: str) -> Any:
        """Compile one ``.cu`` file's text into a loaded module."""

    @abstractmethod
    def _get_function(self, module: Any, name: str) -> Any:
        """The kernel ``name`` of a compiled module."""

    @abstractmethod
    def _launch(
        self, function: Any, grid: Dim3, block: Dim3, args: list[Any], shared_bytes: int
    ) -> None:
        """Enqueue one launch; ``args`` are NumPy scalars only."""

    @abstractmethod
    def is_device_array(self, a: Any) -> bool:
        """Whether ``a`` is this device's array (anything else counts as host data)."""

    @abstractmethod
    def pointer(self, a: Any) -> int:
        """The device address of a device array's first element (views included)."""

    @abstractmethod
    def to_device(self, a: np.ndarray) -> Any:
        """A C-contiguous device copy of a host array."""

    @abstractmethod
    def to_host(self, a: Any) -> np.ndarray:
        """A host copy of a C-contiguous device array."""

    @abstractmethod
    def empty(self, shape: tuple[int, ...], dtype: Any) -> Any:
        """An uninitialised C-contiguous device array."""

    @abstractmethod
    def elapsed_ms(self, run: Callable[[], None], repeats: int) -> float:
        """Mean device time of ``run()`` over ``repeats`` back-to-back calls, in milliseconds."""


class PycudaDevice(CudaDevice):
    """pycuda: the primary context of device 0 (shared with torch/CuPy), nvcc at run time."""

    name = "pycuda"

    def __init__(self) -> None:
        super().__init__()
        if shutil.which("nvcc") is None:
            raise RuntimeError("pycuda compiles the kernels with nvcc, which is not on PATH")
        import pycuda.autoprimaryctx as context  # raises without a driver or a device
        import pycuda.driver as driver
        import pycuda.gpuarray as gpuarray
        from pycuda.compiler import SourceModule
        from pycuda.tools import DeviceMemoryPool

        self._driver, self._gpuarray, self._source_module = driver, gpuarray, SourceModule
        self._allocate = DeviceMemoryPool().allocate
        device = context.device
        attribute = driver.device_attribute
        self.device_name = device.name()
        self.multiprocessor_count = device.get_attribute(attribute.MULTIPROCESSOR_COUNT)
        self.peak_bandwidth = _peak_bandwidth(
            device.get_attribute(attribute.MEMORY_CLOCK_RATE),
            device.get_attribute(attribute.GLOBAL_MEMORY_BUS_WIDTH),
        )

    def _compile(self, code: str) -> Any:
        return self._source_module(code, no_extern_c=True)

    def _get_function(self, module: Any, name: str) -> Any:
        return module.get_function(name)

    def _launch(
        self, function: Any, grid: Dim3, block: Dim3, args: list[Any], shared_bytes: int
    ) -> None:
        function(*args, grid=grid, block=block, shared=shared_bytes)

    def is_device_array(self, a: Any) -> bool:
        return isinstance(a, self._gpuarray.GPUArray)

    def pointer(self, a: Any) -> int:
        return int(a.gpudata)

    def to_device(self, a: np.ndarray) -> Any:
        return self._gpuarray.to_gpu(np.ascontiguousarray(a), allocator=self._allocate)

    def to_host(self, a: Any) -> np.ndarray:
        return a.get()

    def empty(self, shape: tuple[int, ...], dtype: Any) -> Any:
        return self._gpuarray.empty(shape, dtype, allocator=self._allocate)

    def elapsed_ms(self, run: Callable[[], None], repeats: int) -> float:
        start, stop = self._driver.Event(), self._driver.Event()
        start.record()
        for _ in range(repeats):
            run()
        stop.record()
        stop.synchronize()
        return start.time_till(stop) / repeats


class CupyDevice(CudaDevice):
    """CuPy: its current device, NVRTC at run time, CuPy's memory pool."""

    name = "cupy"

    def __init__(self) -> None:
        super().__init__()
        import cupy

        self._cupy = cupy
        runtime = cupy.cuda.runtime
        if runtime.getDeviceCount() < 1:  # raises CUDARuntimeError without a driver
            raise RuntimeError("the CUDA driver reports no device")
        properties = runtime.getDeviceProperties(cupy.cuda.Device().id)
        name = properties["name"]
        self.device_name = name.decode() if isinstance(name, bytes) else str(name)
        self.multiprocessor_count = int(properties["multiProcessorCount"])
        self.peak_bandwidth = _peak_bandwidth(
            properties.get("memoryClockRate"), properties.get("memoryBusWidth")
        )

    def _compile(self, code: str) -> Any:
        return self._cupy.RawModule(code=code)

    def _get_function(self, module: Any, name: str) -> Any:
        return module.get_function(name)

    def _launch(
        self, function: Any, grid: Dim3, block: Dim3, args: list[Any], shared_bytes: int
    ) -> None:
        function(grid, block, tuple(args), shared_mem=shared_bytes)

    def is_device_array(self, a: Any) -> bool:
        return isinstance(a, self._cupy.ndarray)

    def pointer(self, a: Any) -> int:
        return int(a.data.ptr)

    def to_device(self, a: np.ndarray) -> Any:
        return self._cupy.asarray(np.ascontiguousarray(a))

    def to_host(self, a: Any) -> np.ndarray:
        return self._cupy.asnumpy(a)

    def empty(self, shape: tuple[int, ...], dtype: Any) -> Any:
        return self._cupy.empty(shape, dtype)

    def elapsed_ms(self, run: Callable[[], None], repeats: int) -> float:
        start, stop = self._cupy.cuda.Event(), self._cupy.cuda.Event()
        start.record()
        for _ in range(repeats):
            run()
        stop.record()
        stop.synchronize()
        return self._cupy.cuda.get_elapsed_time(start, stop) / repeats


def _peak_bandwidth(memory_clock_khz: int | None, bus_width_bits: int | None) -> float | None:
    """Theoretical DRAM bandwidth in bytes/s: double data rate x clock x bus width."""
    if not memory_clock_khz or not bus_width_bits:
        return None
    return 2.0 * memory_clock_khz * 1e3 * bus_width_bits / 8


class CudaUnavailableError(RuntimeError):
    """No CUDA device can be used here; the message says what is missing."""


_device: CudaDevice | None = None  # loaded once, on the first successful call


def get_device() -> CudaDevice:
    """The CUDA device, loaded on first use; ``CudaUnavailableError`` if there is none.

    A machine without pycuda and CuPy, a driver, a device, or (for pycuda) ``nvcc`` on
    ``PATH`` fails here, naming what is missing, rather than at the first launch. A failed
    load is not cached.
    """
    global _device
    if _device is None:
        _device = _load_device()
    return _device


def _load_device() -> CudaDevice:
    if importlib.util.find_spec("pycuda") is not None:
        loader: type[CudaDevice] = PycudaDevice
    elif importlib.util.find_spec("cupy") is not None:
        loader = CupyDevice
    else:
        raise CudaUnavailableError(
            "neither pycuda nor CuPy is installed (python -m pip install '.[cuda]' adds pycuda)"
        )
    try:
        return loader()
    except Exception as exc:  # no driver (ImportError), no device, no nvcc: all mean no CUDA
        raise CudaUnavailableError(
            f"{loader.name} cannot use a GPU here: {type(exc).__name__}: {exc}"
        ) from exc
