"""mie's CUDA kernels from Python: loading a device, and ``mie.ops`` on it.

``get_device()`` loads the GPU through pycuda (or CuPy) and compiles the kernels of the
top-level ``cuda/`` folder at run time; ``mie.cuda.ops`` holds the GPU versions of
``mie.ops``, same arguments, same results. These are standalone kernels with their tests and
benchmark (``python -m mie.bench --cuda``): no engine path runs on the GPU yet. Importing
this package imports no GPU library, so ``import mie`` works on machines without CUDA. See
docs/cuda.md.
"""

from mie.cuda.device import CudaDevice, CudaUnavailableError, get_device

__all__ = ["CudaDevice", "CudaUnavailableError", "get_device"]
