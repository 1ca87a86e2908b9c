"""Build mie: the pure-Python package, plus the optional Cython extensions: the compiled mirrors
in mie/_fast and the benchmarks' compiled drivers in mie/bench.

The extensions are an accelerator, never a requirement: if Cython is missing or the C
compiler fails, the install still succeeds and mie runs on its pure-Python reference,
after a one-line warning.
"""

import glob
import os
import sys
import tempfile

from setuptools import find_packages, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """build_ext that degrades to pure Python instead of failing the install.

    The extensions form one unit (``mie._fast`` imports them all, and the benchmarks' drivers
    are built on them), so the first failure stops the build with a single warning instead of
    one per module.
    """

    def run(self):
        self._failed = False
        try:
            super().run()
        except Exception as exc:  # no compiler at all, or (editable) no .so to copy in place
            if not self._failed:
                self._warn(exc)

    def build_extensions(self):
        openmp = ["-fopenmp"] if self._compiler_supports_openmp() else []
        for ext in self.extensions:
            ext.extra_compile_args = [*ext.extra_compile_args, *openmp]
            ext.extra_link_args = [*ext.extra_link_args, *openmp]
        super().build_extensions()

    def build_extension(self, ext):
        if self._failed:
            return
        try:
            super().build_extension(ext)
        except Exception as exc:
            self._failed = True
            self._warn(exc, ext.name)

    def _compiler_supports_openmp(self):
        """Compile and link a tiny OpenMP program: kernels run in parallel only if it works."""
        with tempfile.TemporaryDirectory() as tmp:
            source = os.path.join(tmp, "openmp_probe.c")
            with open(source, "w") as f:
                f.write("#include <omp.h>\nint main(void) { return omp_get_max_threads() < 1; }\n")
            flags = {"output_dir": tmp, "extra_postargs": ["-fopenmp"]}
            try:
                objects = self.compiler.compile([source], **flags)
                self.compiler.link_executable(objects, "openmp_probe", **flags)
            except Exception:
                return False
        return True

    @staticmethod
    def _warn(exc, name="mie._fast"):
        print(
            f"WARNING: could not build {name} ({type(exc).__name__}: {exc}); "
            "mie will run in pure Python",
            file=sys.stderr,
        )


def fast_extensions():
    """Cythonize mie/_fast/*.pyx and mie/bench/*.pyx, or return [] when Cython or NumPy is
    unavailable."""
    sources = sorted(glob.glob(os.path.join("mie", "_fast", "*.pyx")))
    sources += sorted(glob.glob(os.path.join("mie", "bench", "*.pyx")))
    if not sources:
        return []
    try:
        import numpy
        from Cython.Build import cythonize
    except ImportError as exc:
        OptionalBuildExt._warn(exc)
        return []
    from setuptools import Extension

    extensions = [
        Extension(
            os.path.splitext(src)[0].replace(os.sep, "."),
            [src],
            include_dirs=[numpy.get_include()],
            extra_compile_args=["-O3"],
            # linear.pyx and ops.pyx include their C kernels (mie/_fast/*.h): a changed header
            # rebuilds them
            depends=sorted(glob.glob(os.path.join("mie", "_fast", "*.h")))
            if src.endswith(("linear.pyx", "ops.pyx"))
            else [],
            define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        )
        for src in sources
    ]
    return cythonize(extensions, compiler_directives={"language_level": "3"}, quiet=True)


# The HTTP server (python -m mie serve): Starlette + uvicorn, and prometheus_client for /metrics.
SERVE = ["starlette>=0.37", "uvicorn>=0.30", "prometheus_client>=0.20"]
# python -m mie serve --replicas N: engine replicas on Ray Serve (docs/distributed.md). Pinned:
# the replicas use Serve's DeploymentHandle streaming, cancellation and run_many.
RAY = [*SERVE, "ray[serve]==2.60.0"]

setup(
    name="mie",
    version="0.1.0",
    description="A miniature LLM inference serving engine: a scheduler over a paged KV pool",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # The CUDA kernel sources live in the top-level cuda/ folder and ship inside the package as
    # mie/cuda_kernels/*.cu, where mie.cuda.sources.kernel_dir() finds them at run time.
    packages=[*find_packages(include=["mie", "mie.*"]), "mie.cuda_kernels"],
    package_dir={"mie.cuda_kernels": "cuda"},
    package_data={"mie.cuda_kernels": ["*.cu"]},
    # numpy is the compute core; tokenizers reads tokenizer.json for text prompts; ml_dtypes is
    # NumPy's bfloat16 dtype (16-bit weights, mie.linear).
    install_requires=[
        "numpy>=1.24",
        "tokenizers>=0.15",
        "ml_dtypes>=0.3",
        "tqdm>=4.60",
        "llguidance>=1.0",  # structured outputs' grammar engine (docs/structured.md)
        "gguf>=0.10",  # GGUF files: llama.cpp's type numbers and dequantizers (mie.gguf_file)
        "jinja2>=3.1",  # chat templates (LLM.chat, the server's chat completions)
    ],
    extras_require={
        # torch==2.13.0 resolves to the CPU wheel here; a bare "torch" pulls a multi-GB CUDA build.
        "test": [
            "pytest>=7",
            "hypothesis>=6.80",
            "torch==2.13.0",
            "transformers",
            "safetensors",
            *SERVE,
            "openai>=1.0",  # the server's tests speak to it with the official client
            "httpx",
            "jsonschema",  # structured outputs are checked by outside validators:
            "lark",  # JSON Schema's reference validator, and a Lark parser for grammars
            "matplotlib",  # the bench's --plot output is tested too
            "gguf",  # the --peers section's GGUF writer (llama.cpp itself stays opt-in: peers)
            *RAY,  # tests/test_serve_ray.py: under CI a missing Ray fails them
        ],
        "bench": ["torch==2.13.0", "transformers", *SERVE, "httpx"],  # httpx: --serve clients
        "cuda": ["pycuda>=2022.1"],  # with pycuda.autoprimaryctx
        "plot": ["matplotlib"],  # python -m mie.bench --plot DIR
        # python -m mie.bench --peers: llama.cpp on the same weights (GGUF files written by gguf).
        # llama-cpp-python compiles llama.cpp from source (minutes); not in "test": its tests skip.
        # sentencepiece: llama.cpp's convert_hf_to_gguf.py imports it for every Llama checkpoint
        # (scripts/perplexity.py converts stories260K with it).
        "peers": ["gguf", "llama-cpp-python", "sentencepiece"],
        "serve": SERVE,
        "ray": RAY,
    },
    ext_modules=fast_extensions(),
    cmdclass={"build_ext": OptionalBuildExt},
)
