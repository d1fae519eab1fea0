#!/usr/bin/env bash
# Gathers the benchmark peers' Python packages into .whl/ (ignored) for the GPU machine, which
# reaches no registry: fla-core (chunk_gated_delta_rule, the Gated DeltaNet peer) with einops,
# and causal-conv1d's sdist; with --build-conv also its CUDA extension built here for sm_90 into
# .whl/causal_conv1d_sm90 (bench/build_causal_conv1d.py; nvcc on the GPU machine took over 200 s,
# longer than a call can spare). Run here, then name .whl in the device tool's `carry`.
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
if [ "${1:-}" = --build-conv ] && [ ! -f causal_conv1d_sm90/causal_conv1d_cuda.so ]; then
  rm -rf /tmp/causal_conv1d_src && mkdir -p /tmp/causal_conv1d_src
  tar xzf causal_conv1d-1.7.0.tar.gz -C /tmp/causal_conv1d_src
  MAX_JOBS=1 nice -n 19 "$root/.venv/bin/python" "$root/bench/build_causal_conv1d.py" \
    /tmp/causal_conv1d_src/causal_conv1d-1.7.0 /tmp/causal_conv1d_build
  mkdir -p causal_conv1d_sm90
  cp -r /tmp/causal_conv1d_build/causal_conv1d /tmp/causal_conv1d_build/causal_conv1d_cuda.so \
    causal_conv1d_sm90/
fi
ls "$root/.whl"
