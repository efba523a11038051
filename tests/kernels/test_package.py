import subprocess
import sys


def test_kernels_import_without_the_engine_and_report_triton():
    code = ("import sys, kernels; assert isinstance(kernels.triton_available(), bool);"
            "assert not [m for m in sys.modules if m.startswith('engine_service')]")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0
