#!/usr/bin/env bash
# Runs pytest on arm64 Python under QEMU (setup.sh first): `tests/arm64/run.sh tests/engine/test_generic_cpu.py`.
# The tests see an aarch64 machine (platform.machine()), so no C kernel builds and every choice takes its PyTorch path,
# as on an arm64 laptop or container.
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR=$(realpath "${ARM64_DIR:-build/arm64}")
export PYTHONPATH="$PWD:$DIR/site" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
# --timeout: emulated, tests run 10-50x slower; pyproject.toml's 600 s is for native runs
exec "$DIR/bin/python3.11" -m pytest -p no:cacheprovider --timeout 3600 "$@"
