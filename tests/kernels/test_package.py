import importlib.metadata
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_kernels_import_without_the_engine_and_report_triton():
    code = ("import sys, decodelab_kernels as k; assert isinstance(k.triton_available(), bool);"
            "assert not [m for m in sys.modules if m.startswith('engine_service')]")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def test_transformers_imports_beside_our_packages():
    """transformers >= 5.25 requires Hugging Face's `kernels` distribution and imports it whenever it is installed;
    our kernels once shipped as a top-level `kernels` package too, which shadowed theirs from the project root (CI:
    `cannot import name 'CUDAProperties' from 'kernels'`). Run from the root, as pytest and `decodelab` are."""
    code = "from transformers import LlamaConfig, Qwen2ForCausalLM; import transformers.integrations.hub_kernels"
    try:
        importlib.metadata.version("kernels")
        # theirs, not a folder of ours
        code += "; import kernels; assert hasattr(kernels, 'get_kernel'), kernels.__file__"
    except importlib.metadata.PackageNotFoundError:
        pass  # transformers < 5.25 without Hugging Face's kernels: only the import above to check
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
