#!/usr/bin/env bash
# Gathers the benchmark peers' Python packages into .whl/ (ignored) for the GPU machine, which
# reaches no registry: fla-core (chunk_gated_delta_rule, the Gated DeltaNet peer) with einops,
# and causal-conv1d's sdist (built there for sm_90 by gpu_check.sh's gdn stage when asked).
# Run here, then name .whl in the device tool's `carry`.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$root/.whl"
cd "$root/.whl"
pip download --no-deps -d . fla-core==0.6.0 einops==0.8.2 > /dev/null
# causal-conv1d publishes no wheel for this torch; pip download would try to build the sdist's
# metadata (it imports torch), so the archive is fetched from the index's simple page.
if [ ! -f causal_conv1d-1.7.0.tar.gz ]; then
  url=$(curl -fsS https://pypi.org/simple/causal-conv1d/ |
    grep -o 'https://[^"#]*causal_conv1d-1\.7\.0\.tar\.gz' | head -1)
  curl -fsSLO "$url"
fi
echo "3202758494eaa7b597ce1c282dfa188889506bfcb92cad3c407d26736bfcd32b  causal_conv1d-1.7.0.tar.gz" |
  sha256sum -c --quiet
ls "$root/.whl"
# causal-conv1d built here into a cp312 wheel for sm_90 (the GPU machine's Python is 3.12 and its
# own build of the sdist takes longer than a device call can spare): only when asked
# (CAUSAL_CONV1D_PYTHON=path to a Python 3.12; about 20-30 minutes of nvcc on 2 cores).
if [ -n "${CAUSAL_CONV1D_PYTHON:-}" ] && ! ls causal_conv1d-1.7.0-cp312-*.whl > /dev/null 2>&1; then
  venv=/tmp/cc1d-venv
  "$CAUSAL_CONV1D_PYTHON" -m venv "$venv"
  "$venv/bin/pip" install -q torch==2.11.0 --no-deps
  # torch --no-deps leaves out what importing torch needs.
  "$venv/bin/pip" install -q packaging ninja setuptools wheel typing_extensions filelock sympy \
    networkx jinja2 fsspec
  # Importing torch loads its CUDA libraries, which --no-deps left out: the test venv's copies
  # (the same torch version, other Python) serve.
  nvidia=("$root"/.venv/lib/python3*/site-packages/nvidia)
  LD_LIBRARY_PATH=$(ls -d "${nvidia[0]}"/*/lib | tr '\n' ':')${LD_LIBRARY_PATH:-}
  export LD_LIBRARY_PATH
  src=$(mktemp -d)
  tar xzf causal_conv1d-1.7.0.tar.gz -C "$src"
  # setup.py lists nine architectures; the H200 needs sm_90 alone.
  sed -i 's/^    if FORCE_CXX11_ABI:/    cc_flag = ["-gencode", "arch=compute_90,code=sm_90"]\n&/' \
    "$src/causal_conv1d-1.7.0/setup.py"
  CAUSAL_CONV1D_FORCE_BUILD=TRUE MAX_JOBS=${MAX_JOBS:-2} "$venv/bin/pip" wheel --no-deps \
    --no-build-isolation -w . "$src/causal_conv1d-1.7.0"
  rm -rf "$src"
fi
