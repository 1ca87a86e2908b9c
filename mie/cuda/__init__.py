"""The CUDA path: the kernels of ``cuda/*.cu``, compiled at run time by pycuda (or CuPy).

``select_device`` decides between CPU and CUDA (``MIE_WITH_CUDA=1`` or ``device="cuda"``);
``mie.cuda.ops`` holds the GPU versions of ``mie.ops``. Importing this package imports no GPU
library: pycuda or CuPy is loaded only when CUDA is actually requested, so ``import mie`` and
every CPU code path work on machines without CUDA. See docs/cuda.md.
"""

from mie.cuda.device import ENV_SWITCH, CudaUnavailableError, get_backend, select_device

__all__ = ["ENV_SWITCH", "CudaUnavailableError", "get_backend", "select_device"]
