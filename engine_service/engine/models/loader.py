"""Model sources -> a local Hugging Face directory (config.json, *.safetensors, tokenizer files).

GGUF sources are dequantised once with transformers and cached as fp32 safetensors under
`~/.cache/decodelab/models/<name>` (or $DECODELAB_CACHE_DIR/<name>); later loads read the cache.
"""

import contextlib
import functools
import hashlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from engine_service.engine.models.registry import REGISTRY, available_models


def default_cache_dir() -> Path:
    env = os.environ.get("DECODELAB_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "decodelab" / "models"


def is_hf_model_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def resolve_model(model: str, cache_dir: str | None = None) -> Path:
    """A registry name, a local HF model directory or a .gguf file -> a local HF model directory."""
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    if model in REGISTRY:
        return _cached_conversion(cache / model, REGISTRY[model].source.locate)
    path = Path(model).expanduser()
    if is_hf_model_dir(path):
        return path.resolve()
    if path.suffix == ".gguf" and path.is_file():
        path = path.resolve()
        key = hashlib.sha256(f"{path}:{path.stat().st_size}:{path.stat().st_mtime_ns}".encode()).hexdigest()[:8]
        return _cached_conversion(cache / f"{path.stem}-{key}", lambda workdir: path)
    raise ValueError(f"unknown model {model!r}: not a registry name ({', '.join(available_models())}), "
                     "nor a Hugging Face model directory (config.json + *.safetensors), nor a readable .gguf file")


def _cached_conversion(target: Path, locate_gguf) -> Path:
    if is_hf_model_dir(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build in a sibling tmp dir and rename it into place: a crash leaves no half-written cache.
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    tmp.chmod(0o755)
    try:
        _progress(f"{target.name}: not cached yet, locating its GGUF (chunked models are assembled and verified)")
        _convert_gguf(locate_gguf(tmp), tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process finished first, or a stale partial target exists
            if not is_hf_model_dir(target):
                shutil.rmtree(target, ignore_errors=True)
                tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert_gguf(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()

    def step(msg: str) -> None:
        _progress(f"{time.perf_counter() - start:5.1f}s {msg}")

    step(f"loading GGUF {gguf} (one-time conversion to {out.parent}) ...")
    with gguf_parsed_once():
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        step("loading tokenizer from GGUF ...")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # save_pretrained refuses a GGUF-loaded (quantized) model until these are gone; weights are fp32 now
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    step("saving safetensors ...")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if gguf.parent == out:
        gguf.unlink()  # an assembled chunked GGUF is only needed for the conversion
    step("done")


@contextlib.contextmanager
def gguf_parsed_once():
    """Within it, the gguf package's file reader and tensor-name map are built once per file / architecture.

    transformers' GGUF loading builds the name map again for every module of the model (397 times for SmolLM2)
    and parses the file three times (config, tensors, tokenizer; the vocabulary field by field in Python): a
    first `play` converted SmolLM2 in 25.9 s, 12.5 s with this (the same files, byte for byte; the 2-core AMD
    EPYC). Both are only read by their callers."""
    import gguf

    saved = gguf.get_tensor_name_map, gguf.GGUFReader
    readers: dict[tuple[str, str], object] = {}

    def reader(path, mode: str = "r"):
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = saved[1](path, mode)
        return readers[key]

    gguf.get_tensor_name_map, gguf.GGUFReader = functools.lru_cache(maxsize=None)(saved[0]), reader
    try:
        yield
    finally:
        gguf.get_tensor_name_map, gguf.GGUFReader = saved


def _progress(msg: str) -> None:
    print(f"[decodelab] {msg}", file=sys.stderr, flush=True)


def load_weights(model_dir: str | Path) -> dict[str, torch.Tensor]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_dir}")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(f))
    return weights


def load_config(model_dir: str | Path):
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(str(model_dir))


def head_dim(hf_config) -> int:
    """Width of one attention head: the config's head_dim where it sets one (it may differ from
    hidden_size / heads), else hidden_size / heads."""
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def max_model_len(hf_config, requested: int | None) -> int:
    """The longest sequence (prompt + output) the engine runs: `requested` (EngineConfig.max_model_len),
    capped at the positions the model has RoPE tables for; the model's context when None."""
    return min(requested or hf_config.max_position_embeddings, hf_config.max_position_embeddings)


def load_tokenizer(model_dir: str | Path):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(model_dir))
