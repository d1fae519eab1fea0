#!/usr/bin/env bash
# One-time (and idempotent) set-up of a fresh Debian 12 machine: system packages, a venv
# under the repo with torch (whose bundled LibTorch we link) and the Python test references,
# then a configured build directory. Re-running it only does what is missing.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

TORCH_VERSION=2.11.0
APT_PACKAGES=(build-essential cmake ninja-build ccache pkg-config python3-venv
  nlohmann-json3-dev libfmt-dev libcli11-dev libgtest-dev libgmock-dev libbenchmark-dev
  libpcre2-dev clang-14 libclang-rt-14-dev libgloo-dev libyaml-cpp-dev)

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
if ! .venv/bin/python -c "import torch,sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null \
   || ! .venv/bin/python -c "import transformers, safetensors, tokenizers, numpy, tensorboard" 2>/dev/null; then
  echo "setup: installing torch==$TORCH_VERSION and the Python test references into .venv"
  .venv/bin/pip install -q --disable-pip-version-check "torch==$TORCH_VERSION" \
    transformers safetensors tokenizers numpy jinja2 tensorboard
fi
"$root/scripts/fetch_cudnn_frontend.sh"
echo "setup: done"
