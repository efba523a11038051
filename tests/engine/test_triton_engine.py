import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
HERE = Path(__file__).parent
PADDED = "test_cuda_graphs.py::test_padded_decode_batch_matches_unpadded_and_padding_writes_no_kv"


def test_engine_on_the_triton_backend_matches_torch_under_the_interpreter():
    # A fresh process: triton.jit picks interpreter vs GPU when kernels are decorated, and in this process
    # triton may already be imported without TRITON_INTERPRET. DECODELAB_ATTENTION_BACKEND=triton makes
    # the padded-decode check of test_cuda_graphs.py run the Triton kernels over a padded static batch.
    env = {**os.environ, "TRITON_INTERPRET": "1", "DECODELAB_ATTENTION_BACKEND": "triton",
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          str(HERE / "triton_engine_cases.py"), str(HERE / PADDED)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-8000:] + run.stderr[-2000:]
    assert "3 passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]
