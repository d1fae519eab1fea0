#!/usr/bin/env bash
# The cuDNN frontend's C++ headers (NVIDIA's header-only graph API, MIT; the same library
# LibTorch's own cuDNN attention is built on) into .deps/cudnn-frontend/include (ignored):
# from its PyPI wheel, unpacked, nothing installed. setup.sh runs it for CI; gather_deps.sh for
# the GPU machine, which reaches no registry and gets the folder through the device tool's carry.
# Idempotent; usage: scripts/fetch_cudnn_frontend.sh [python]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
version=1.32.0
dest=$root/.deps/cudnn-frontend
python=${1:-$root/.venv/bin/python}
[ -x "$python" ] || python=python3
if [ -f "$dest/include/cudnn_frontend.h" ] && [ "$(cat "$dest/VERSION" 2>/dev/null)" = "$version" ]; then
  exit 0
fi
mkdir -p "$dest/wheel"
# The wheel is platform-specific only for its Python module; the headers are the same in all.
"$python" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
  -d "$dest/wheel" "nvidia-cudnn-frontend==$version"
rm -rf "$dest/include"
"$python" - "$dest" <<'PY'
import glob, sys, zipfile
dest = sys.argv[1]
(wheel,) = glob.glob(f"{dest}/wheel/nvidia_cudnn_frontend-*.whl")
with zipfile.ZipFile(wheel) as z:
    z.extractall(dest, [n for n in z.namelist() if n.startswith("include/")])
PY
rm -rf "$dest/wheel"
echo "$version" > "$dest/VERSION"
echo "fetch_cudnn_frontend: cuDNN frontend $version headers in $dest/include"
