"""Perplexity of stories260K per weight format, mie's against llama.cpp's, on the same tokens.

    LLAMA_CPP_SOURCE=/path/to/llama_cpp_python-X.tar.gz python scripts/perplexity.py \\
        [--json perplexity.json] [--backend fast|python] [--mie-only]

What it measures, in about half a minute:

* **The text**: ``tests/data/heldout/tinystories_like.txt`` (34 stories written for mie in
  TinyStories' style; see the README beside it), each story tokenized by the checkpoint's
  tokenizer (mie's ``Tokenizer``) with its BOS in front, all stories one stream -- how
  llama2.c, which trained stories260K, lays out TinyStories. The stream is cut into
  non-overlapping windows of the model's context, 512 tokens (the last one shorter), and every
  token of a window but its first is scored given the window's tokens before it. Perplexity
  is ``exp(mean negative log-likelihood)`` over all scored tokens (natural log, float64
  log-softmax of float32 logits).
* **mie**: ``Model.from_pretrained(..., dtype=, quantization=)`` in float32, bfloat16, float16,
  int8 and int4 (int8 and int4 quantized from the float32 values), a float32 KV cache, every
  window prefilled in one forward pass that returns every position's logits.
* **llama.cpp** (llama-cpp-python, the opt-in ``peers`` extra): the same checkpoint converted
  by llama.cpp's own ``convert_hf_to_gguf.py`` to f32, f16 and q8_0, then quantized by
  ``llama_model_quantize`` from the f32 file to q4_0 and q4_K_M; each file evaluated with
  ``logits_all`` and a float32 KV cache on the very same token ids (fed as ids: llama.cpp's
  tokenizer plays no part), one ``eval`` per window from an empty cache.
* **The formats each tensor really got**: read back from each GGUF file (llama.cpp leaves a
  matrix in another type when its row length is not a multiple of the block, 32 or 256) and
  from mie's loaded weights (mie stores int4's matrices whose input dimension is not a
  multiple of 32 as int8).
* **Q4_0 against Q4_K on Qwen2-0.5B-shaped matrices**: the relative RMS error of
  ``dequantize(quantize(w))`` for random normal matrices of that model's shapes, quantized
  by llama.cpp's own C quantizer (``ggml_quantize_chunk``, no importance matrix) and read
  back by ``gguf.quants.dequantize``.

The converter is not in llama-cpp-python's wheel, only in its source distribution (under
``vendor/llama.cpp/``) or a llama.cpp checkout: pass either as ``--llama-cpp-source`` or
``LLAMA_CPP_SOURCE`` (a ``.tar.gz`` is unpacked once into ``~/.cache/mie``). The converter
needs ``torch`` and ``sentencepiece`` (it imports sentencepiece for every Llama checkpoint).
``--mie-only`` skips llama.cpp. The table goes to stdout, everything to ``--json``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's mie, wherever the script is run from

from mie.backend import Backend, select  # noqa: E402
from mie.bench.accuracy import teacher_forced_logits  # noqa: E402
from mie.engine.tokenizer import Tokenizer  # noqa: E402
from mie.model import Model  # noqa: E402

MODEL = ROOT / "models" / "stories260K"
TEXT = ROOT / "tests" / "data" / "heldout" / "tinystories_like.txt"
STORY_SEPARATOR = "<|endoftext|>"  # as in TinyStories' own text files
WINDOW = 512  # stories260K's context (max_position_embeddings)

MIE_FORMATS = (  # (label, dtype, quantization): int8 and int4 from the float32 values
    ("float32", "float32", None),
    ("bfloat16", "bfloat16", None),
    ("float16", "float16", None),
    ("int8", "float32", "int8"),
    ("int4", "float32", "int4"),
)
CONVERTED = ("f32", "f16", "q8_0")  # written by convert_hf_to_gguf.py --outtype
QUANTIZED = {"q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}  # from f32
REFERENCE_FORMAT = {"mie": "float32", "llama.cpp": "f32"}  # what each increase is over

MATRIX_SHAPES = (  # (model, matrix, out, in): Qwen2-0.5B's (hidden 896 = 3.5 x 256), 1.5B's
    ("Qwen2-0.5B", "q_proj / o_proj", 896, 896),
    ("Qwen2-0.5B", "k_proj / v_proj", 128, 896),
    ("Qwen2-0.5B", "gate_proj / up_proj", 4864, 896),
    ("Qwen2-0.5B", "down_proj", 896, 4864),
    ("Qwen2-1.5B", "q_proj / o_proj", 1536, 1536),
    ("Qwen2-1.5B", "gate_proj / up_proj", 8960, 1536),
    ("Qwen2-1.5B", "down_proj", 1536, 8960),
)
MATRIX_DISTRIBUTIONS = ("normal", "student-t(4)")  # the second with heavier tails (outliers)
MATRIX_TYPES = ("Q4_0", "Q4_K", "Q5_0")  # Q5_0: what llama.cpp stores where Q4_K cannot be


# -- the text and the perplexity ----------------------------------------------------------------


def read_stories(path: Path = TEXT) -> list[str]:
    """The stories of a held-out text file, separated by ``<|endoftext|>`` lines."""
    return [s.strip() for s in path.read_text(encoding="utf-8").split(STORY_SEPARATOR) if s.strip()]


def token_stream(tokenizer: Tokenizer, stories: list[str]) -> list[int]:
    """Every story's token ids, each story with the tokenizer's BOS in front, end to end."""
    return [token for story in stories for token in tokenizer.encode(story)]


def windows(tokens: list[int], length: int = WINDOW) -> list[list[int]]:
    """``tokens`` cut into non-overlapping windows of ``length`` (the last one shorter); a
    last window of a single token is dropped (it has nothing to score)."""
    cut = [tokens[start : start + length] for start in range(0, len(tokens), length)]
    return [window for window in cut if len(window) > 1]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def negative_log_likelihood(logits: np.ndarray, window: list[int]) -> np.ndarray:
    """``-log p(window[t + 1] | window[: t + 1])`` for every ``t``: ``logits`` is the window's
    ``(len(window), vocab)``, row ``t`` the prediction after token ``t``."""
    targets = np.asarray(window[1:])
    return -log_softmax(logits[:-1])[np.arange(len(targets)), targets]


def perplexity(all_logits: list[np.ndarray], all_windows: list[list[int]]) -> float:
    """``exp`` of the mean negative log-likelihood over every scored token of every window."""
    nll = [negative_log_likelihood(lg, w) for lg, w in zip(all_logits, all_windows, strict=True)]
    return float(np.exp(np.concatenate(nll).mean()))


# -- mie ----------------------------------------------------------------------------------------


def mie_logits(model: Model, backend: Backend, all_windows: list[list[int]]) -> list[np.ndarray]:
    """Every position's logits of every window, all windows prefilled together in one forward
    pass into a float32 KV cache."""
    return teacher_forced_logits(model, backend, all_windows, "float32", decode=0)


def mie_matrix_formats(model: Model) -> dict[str, list[str]]:
    """The model's matrices grouped by stored format, as ``matrix_types`` groups a GGUF
    file's (int4 keeps as int8 those whose input dimension is not a multiple of 32)."""
    w = model.weights
    matrices = [("embed / lm_head" if w.lm_head is w.embed else "embed", w.embed)]
    if w.lm_head is not w.embed:
        matrices.append(("lm_head", w.lm_head))
    for layer in w.layers:
        matrices += [(name, getattr(layer, name)) for name in ("qkv", "o", "gate_up", "down")]
    return grouped_names((name, matrix.format) for name, matrix in matrices)


def mie_rows(directory: Path, backend: Backend, all_windows: list[list[int]]) -> list[dict]:
    """One row per mie format."""
    models = {
        label: Model.from_pretrained(
            directory, backend.kernels, dtype=dtype, quantization=quantization
        )
        for label, dtype, quantization in MIE_FORMATS
    }
    return [
        {
            "engine": "mie",
            "format": label,
            "perplexity": perplexity(mie_logits(model, backend, all_windows), all_windows),
            "weight_bytes": model.weights.nbytes,
            "matrix_formats": mie_matrix_formats(model),
        }
        for label, model in models.items()
    ]


# -- llama.cpp ----------------------------------------------------------------------------------


def llama_cpp_source(given: str | None) -> Path:
    """The llama.cpp tree holding ``convert_hf_to_gguf.py``: ``given`` (or ``LLAMA_CPP_SOURCE``)
    is such a tree, or llama-cpp-python's source distribution, whose ``vendor/llama.cpp`` is
    unpacked once into ``~/.cache/mie/<sdist name>``."""
    given = given or os.environ.get("LLAMA_CPP_SOURCE")
    if not given:
        raise SystemExit(
            "llama.cpp's convert_hf_to_gguf.py is needed: pass --llama-cpp-source (or set "
            "LLAMA_CPP_SOURCE to) a llama.cpp checkout or llama-cpp-python's .tar.gz "
            "(pip download llama-cpp-python==VERSION --no-deps --no-binary :all:), "
            "or --mie-only"
        )
    path = Path(given).expanduser()
    if path.is_dir():
        for tree in (path, path / "vendor" / "llama.cpp"):
            if (tree / "convert_hf_to_gguf.py").is_file():
                return tree
        raise SystemExit(f"{path}: no convert_hf_to_gguf.py (nor vendor/llama.cpp/ holding one)")
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mie"
    tree = cache / path.name.removesuffix(".tar.gz") / "llama.cpp"
    if not (tree / "convert_hf_to_gguf.py").is_file():
        with tarfile.open(path) as archive:
            members = []
            for member in archive.getmembers():
                parts = member.name.split("/")
                if parts[1:3] == ["vendor", "llama.cpp"] and len(parts) > 3:
                    if parts[3] in ("convert_hf_to_gguf.py", "conversion", "gguf-py"):
                        member.name = "/".join(parts[3:])
                        members.append(member)
            if not members:
                raise SystemExit(f"{path}: no vendor/llama.cpp/convert_hf_to_gguf.py inside")
            tree.mkdir(parents=True, exist_ok=True)
            archive.extractall(tree, members=members, filter="data")
    return tree


def convert(source: Path, model_dir: Path, outtype: str, out: Path) -> Path:
    """``convert_hf_to_gguf.py model_dir --outtype outtype`` (llama.cpp's own converter)."""
    command = [sys.executable, str(source / "convert_hf_to_gguf.py"), str(model_dir)]
    command += ["--outtype", outtype, "--outfile", str(out)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout[-2000:]}{done.stderr[-4000:]}")
    return out


def quantize(source: Path, out: Path, ftype_name: str) -> Path:
    """llama.cpp's quantizer (``llama_model_quantize``, its default parameters) to ``ftype``."""
    import llama_cpp

    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # not every tensor's line
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, ftype_name)
    if llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), params):
        raise SystemExit(f"llama_model_quantize {source} -> {ftype_name} failed")
    return out


def gguf_tensor_types(path: Path) -> dict[str, str]:
    """Every tensor's name and stored type (F32, F16, Q8_0, ...) as the file holds it."""
    import gguf

    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


def matrix_types(types: dict[str, str]) -> dict[str, list[str]]:
    """A GGUF file's matrices (norms left out) grouped by stored type, ``blk.N.`` left out of
    the names: ``{"Q4_0": ["attn_q x5", ...], ...}``."""
    matrices = [
        (
            name.removesuffix(".weight").split(".", 2)[-1]
            if name.startswith("blk.")
            else name.removesuffix(".weight"),
            kind,
        )
        for name, kind in types.items()
        if "norm" not in name
    ]
    return grouped_names(matrices)


def grouped_names(named_formats) -> dict[str, list[str]]:
    """``(name, format)`` pairs as ``{format: ["name xN", ...]}``, N the times a name (one per
    layer) has that format, in first-seen order."""
    counts: dict[str, dict[str, int]] = {}
    for name, kind in named_formats:
        counts.setdefault(kind, {}).setdefault(name, 0)
        counts[kind][name] += 1
    return {
        kind: [f"{name} x{n}" if n > 1 else name for name, n in names.items()]
        for kind, names in counts.items()
    }


def llama_cpp_logits(path: Path, all_windows: list[list[int]], threads: int) -> list[np.ndarray]:
    """Every position's logits of every window: one ``eval`` of the window's ids from an empty
    KV cache (float32, like mie's reference), every row's logits kept."""
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=str(path),
        n_ctx=WINDOW,
        n_batch=WINDOW,
        n_ubatch=WINDOW,
        logits_all=True,
        type_k=llama_cpp.GGML_TYPE_F32,
        type_v=llama_cpp.GGML_TYPE_F32,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    out = []
    for window in all_windows:
        llm.reset()
        llm.eval(window)
        out.append(np.array(llm.scores[: len(window)], dtype=np.float32))
    llm.close()
    return out


def llama_cpp_files(source: Path, model_dir: Path, directory: Path) -> dict[str, Path]:
    """GGUF files of ``model_dir`` in every llama.cpp format of the table."""
    files = {t: convert(source, model_dir, t, directory / f"{t}.gguf") for t in CONVERTED}
    for label, ftype in QUANTIZED.items():
        files[label] = quantize(files["f32"], directory / f"{label}.gguf", ftype)
    return files


def llama_cpp_rows(
    source: Path, model_dir: Path, all_windows: list[list[int]], threads: int
) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, path in llama_cpp_files(source, model_dir, Path(tmp)).items():
            ppl = perplexity(llama_cpp_logits(path, all_windows, threads), all_windows)
            rows.append(
                {
                    "engine": "llama.cpp",
                    "format": label,
                    "perplexity": ppl,
                    "file_bytes": path.stat().st_size,
                    "matrix_formats": matrix_types(gguf_tensor_types(path)),
                }
            )
    return rows


# -- Q4_0 against Q4_K on Qwen2-0.5B-shaped matrices --------------------------------------------


def ggml_quantize(values: np.ndarray, type_name: str) -> np.ndarray:
    """``values (rows, n)`` quantized by llama.cpp's C quantizer (``ggml_quantize_chunk`` from
    llama-cpp-python's libggml-base, no importance matrix): the raw blocks, ``(rows, bytes)``."""
    import gguf
    import llama_cpp

    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_void_p,
    ]
    qtype = gguf.GGMLQuantizationType[type_name]
    values = np.ascontiguousarray(values, dtype=np.float32)
    out = np.zeros(gguf.quant_shape_to_byte_shape(values.shape, qtype), dtype=np.uint8)
    lib.ggml_quantize_init(int(qtype))
    written = lib.ggml_quantize_chunk(
        int(qtype), values.ctypes.data, out.ctypes.data, 0, values.shape[0], values.shape[1], None
    )
    if written != out.nbytes:
        raise RuntimeError(f"ggml_quantize_chunk wrote {written} bytes, expected {out.nbytes}")
    return out


def relative_rms_error(values: np.ndarray, type_name: str) -> float:
    """``rms(dequantize(quantize(w)) - w) / rms(w)``."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    restored = gguf.quants.dequantize(ggml_quantize(values, type_name), qtype)
    return float(np.sqrt(np.mean((restored - values) ** 2) / np.mean(values**2)))


def matrix_error_rows(seed: int = 0) -> list[dict]:
    """Each type's relative RMS error on random matrices of Qwen2's shapes; Q4_K's is None
    where the input dimension is not a multiple of its 256-weight super-block (llama.cpp then
    stores Q5_0 instead)."""
    rng = np.random.default_rng(seed)
    rows = []
    for distribution in MATRIX_DISTRIBUTIONS:
        for model, name, out_features, in_features in MATRIX_SHAPES:
            shape = (out_features, in_features)
            if distribution == "normal":
                values = rng.standard_normal(shape, dtype=np.float32)
            else:
                values = rng.standard_t(4, shape).astype(np.float32)
            row = {"model": model, "matrix": name, "shape": list(shape)}
            row["distribution"] = distribution
            for type_name in MATRIX_TYPES:
                fits = in_features % _block_size(type_name) == 0
                row[type_name] = relative_rms_error(values, type_name) if fits else None
            rows.append(row)
    return rows


def _block_size(type_name: str) -> int:
    import gguf

    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]][0]


# -- the report ---------------------------------------------------------------------------------


def with_increases(rows: list[dict]) -> list[dict]:
    """Each row with ``increase``: its perplexity less its engine's float32 / f32 perplexity."""
    reference = {
        r["engine"]: r["perplexity"] for r in rows if r["format"] == REFERENCE_FORMAT[r["engine"]]
    }
    return [dict(r, increase=r["perplexity"] - reference[r["engine"]]) for r in rows]


def int4_ratios(rows: list[dict]) -> dict[str, float]:
    """Perplexity increase of mie's int4 over float32, divided by
    llama.cpp q4_0's over f32 (the target: at most 1.1); empty without llama.cpp's rows."""
    increase = {(r["engine"], r["format"]): r["increase"] for r in rows}
    if ("llama.cpp", "q4_0") not in increase:
        return {}
    q4_0 = increase["llama.cpp", "q4_0"]
    return {"int4": increase["mie", "int4"] / q4_0}


def table(result: dict) -> str:
    lines = [
        f"stories260K on {result['text']}: {result['tokens']} tokens, {result['windows']} "
        f"windows of up to {WINDOW}, {result['scored']} tokens scored",
        "",
        "| engine | format | perplexity | increase over float32 | matrices stored as |",
        "| --- | --- | ---: | ---: | --- |",
    ]
    for r in result["rows"]:
        stored = "; ".join(f"{k}: {', '.join(v)}" for k, v in r["matrix_formats"].items())
        lines.append(
            f"| {r['engine']} | {r['format']} | {r['perplexity']:.4f} | {r['increase']:+.4f} "
            f"| {stored} |"
        )
    for label, ratio in result["int4_ratios"].items():
        lines += ["", f"mie {label} increase / llama.cpp q4_0 increase: {ratio:.3f}"]
    if result["matrix_errors"]:
        lines += [
            "",
            "relative RMS error of dequantize(quantize(w)), random w, llama.cpp's C quantizer "
            "(n/a: the input dimension is not a multiple of Q4_K's 256):",
            "",
            "| model | matrix | shape | w | Q4_0 | Q4_K | Q5_0 | Q4_K / Q4_0 |",
            "| --- | --- | --- | --- | ---: | ---: | ---: | ---: |",
        ]
        for r in result["matrix_errors"]:
            q4k = "n/a" if r["Q4_K"] is None else f"{r['Q4_K']:.4f}"
            ratio = "n/a" if r["Q4_K"] is None else f"{r['Q4_K'] / r['Q4_0']:.3f}"
            lines.append(
                f"| {r['model']} | {r['matrix']} | {r['shape'][0]} x {r['shape'][1]} "
                f"| {r['distribution']} | {r['Q4_0']:.4f} | {q4k} | {r['Q5_0']:.4f} | {ratio} |"
            )
    return "\n".join(lines)


def measure(options: argparse.Namespace) -> dict:
    """Every figure of the report (``main``'s options)."""
    start = time.perf_counter()
    backend = select(options.backend)
    tokens = token_stream(Tokenizer(options.model), read_stories(options.text))
    all_windows = windows(tokens)
    rows = mie_rows(options.model, backend, all_windows)
    matrix_errors: list[dict] = []
    versions = {"python": platform.python_version(), "numpy": np.__version__}
    if not options.mie_only:
        import gguf  # noqa: F401  (fail here, before converting, when a package is missing)
        import llama_cpp
        import sentencepiece  # noqa: F401  (convert_hf_to_gguf.py imports it for Llama)

        source = llama_cpp_source(options.source)
        rows += llama_cpp_rows(source, options.model, all_windows, options.threads)
        matrix_errors = matrix_error_rows()
        versions |= {"llama_cpp_python": llama_cpp.__version__, "converter": str(source)}
    rows = with_increases(rows)
    return {
        "model": str(options.model),
        "text": str(
            options.text.relative_to(ROOT) if options.text.is_relative_to(ROOT) else options.text
        ),
        "tokens": len(tokens),
        "windows": len(all_windows),
        "scored": sum(len(w) - 1 for w in all_windows),
        "backend": backend.name,
        "rows": rows,
        "int4_ratios": int4_ratios(rows),
        "matrix_errors": matrix_errors,
        "versions": versions,
        "seconds": time.perf_counter() - start,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=MODEL)
    parser.add_argument("--text", type=Path, default=TEXT)
    parser.add_argument("--backend", choices=("python", "fast"), default=None)
    parser.add_argument("--llama-cpp-source", dest="source", default=None)
    parser.add_argument("--mie-only", action="store_true", help="skip llama.cpp")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", type=Path, default=None, help="write every figure here")
    args = parser.parse_args(argv)
    args.model, args.text = args.model.resolve(), args.text.resolve()
    result = measure(args)
    print(table(result))
    print(f"\n{result['seconds']:.0f} s, backend {result['backend']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
