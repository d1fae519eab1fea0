"""Builds causal-conv1d 1.7.0's CUDA extension (the Gated DeltaNet conv peer of bench/gdn_peer.py)
for sm_90 alone with the nvcc flags of its setup.py, through torch's cpp_extension instead of its
wheel machinery (the test venv has no `wheel`); the .so and the package's Python files go to OUT,
which is what PYTHONPATH needs. Here: about 17 minutes on the 2-core machine, nice'd (this venv's
torch is the GPU machine's, 2.11.0+cu130, with nvcc 13.0); scripts/gather_peers.sh --build-conv.

usage: build_causal_conv1d.py SOURCE_DIR OUT
"""
import os
import shutil
import sys

from torch.utils.cpp_extension import load

src = sys.argv[1]
out = sys.argv[2]
os.makedirs(out, exist_ok=True)
flags = ["-O3", "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
         "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
         "-U__CUDA_NO_BFLOAT162_OPERATORS__", "-U__CUDA_NO_BFLOAT162_CONVERSIONS__",
         "--expt-relaxed-constexpr", "--expt-extended-lambda", "--use_fast_math",
         "-gencode", "arch=compute_90,code=sm_90"]
os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"
load(name="causal_conv1d_cuda",
     sources=[f"{src}/csrc/{f}" for f in ["causal_conv1d.cpp", "causal_conv1d_fwd.cu",
                                          "causal_conv1d_bwd.cu", "causal_conv1d_update.cu"]],
     extra_cflags=["-O3"], extra_cuda_cflags=flags, extra_include_paths=[f"{src}/csrc"],
     build_directory=out, verbose=False, is_python_module=True)
shutil.copytree(f"{src}/causal_conv1d", f"{out}/causal_conv1d", dirs_exist_ok=True)
print("built", out)
