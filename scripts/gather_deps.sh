#!/usr/bin/env bash
# Gathers the Debian packages the build needs beyond LibTorch into .deps/root (ignored), for
# the GPU machine, which reaches no registry: `apt-get download` + `dpkg -x`, no install.
# Run here, then name .deps in the device tool's `carry`.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$root/.deps/debs" "$root/.deps/root"
cd "$root/.deps/debs"
# libgloo-dev for its headers only (ProcessGroupGloo.hpp includes them; gloo itself is inside
# LibTorch); libyaml-cpp0.7 is the .so behind libyaml-cpp-dev's link.
packages=(nlohmann-json3-dev libcli11-dev libgtest-dev libgmock-dev
  libpcre2-dev libpcre2-8-0 libgloo-dev libyaml-cpp-dev libyaml-cpp0.7)
for p in "${packages[@]}"; do
  ls "${p}"_*.deb >/dev/null 2>&1 || apt-get download "$p" >/dev/null
done
for f in *.deb; do dpkg -x "$f" "$root/.deps/root"; done
# Debian's .so links are absolute; make them relative so the tree can move.
find "$root/.deps/root" -type l | while read -r link; do
  target=$(readlink "$link")
  case "$target" in /*) ln -sfn "$(basename "$target")" "$link" ;; esac
done
du -sh "$root/.deps/root"
"$root/scripts/fetch_cudnn_frontend.sh"
# GSM8K for the end-to-end run (gpu_check.sh's gsm8k stages read .deps/gsm8k).
if [ -f "$root/../shared/data/gsm8k/train.jsonl" ]; then
  mkdir -p "$root/.deps/gsm8k"
  cp "$root/../shared/data/gsm8k/"{train,test}.jsonl "$root/.deps/gsm8k/"
fi
