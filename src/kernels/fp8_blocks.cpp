#include "kernels/fp8_blocks.h"

#include <ATen/cuda/CUDAContext.h>
#include <fmt/ranges.h>

#include "common/error.h"
#include "kernels/fp8_rows.h"

namespace dflash::kernels {

void quantize_groups_e4m3_cuda(const at::Tensor& x, at::Tensor& data,
                               at::Tensor& scale_storage);  // fp8_blocks.cu

namespace {

int64_t blocks_of(int64_t size) { return (size + kFp8Block - 1) / kFp8Block; }

void check_group_input(const at::Tensor& x) {
  if (x.dim() != 2 || x.size(1) % kFp8Block != 0) {
    fail("fp8 group quantize: expected a matrix of a multiple of {} columns, got {}", kFp8Block,
         x.sizes());
  }
}

void check_groups(const Fp8Groups& a) {
  if (a.data.dim() != 2 || a.data.scalar_type() != at::kFloat8_e4m3fn || !a.data.is_contiguous() ||
      a.data.size(1) % kFp8Block != 0) {
    fail("fp8 block GEMM: a must be contiguous float8_e4m3fn [rows, a multiple of {}], got {} {}",
         kFp8Block, a.data.sizes(), c10::toString(a.data.scalar_type()));
  }
  const int64_t m = a.data.size(0), groups = a.data.size(1) / kFp8Block;
  if (a.scale.sizes() != at::IntArrayRef{m, groups} || a.scale.scalar_type() != at::kFloat ||
      (m > 1 && a.scale.stride(0) != 1) || (groups > 1 && a.scale.stride(1) != m)) {
    fail("fp8 block GEMM: a's scale must be fp32 [{}, {}] of strides [1, {}], got {} of strides {}",
         m, groups, m, a.scale.sizes(), a.scale.strides());
  }
}

// The kernels' dtypes and layout: one CUDA device, bf16 or fp16, unit column stride.
bool half_precision_on_cuda(const at::Tensor& x) {
  return x.is_cuda() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf) &&
         (x.stride(1) == 1 || x.size(1) <= 1);
}

// Whether mm_fp8_blocks_out runs cuBLASLt's block-scaled GEMM on `device`: the DeepSeek recipe
// (1 x 128 and 128 x 128 scales) is implemented for compute capability 9.0 alone.
bool fp8_block_gemm_supported(at::Device device) {
  if (!fp8_gemm_supported(device)) return false;
  return at::cuda::getDeviceProperties(device.index() < 0 ? 0 : device.index())->major == 9;
}

}  // namespace

Fp8Groups quantize_groups_e4m3_reference(const at::Tensor& x) {
  check_group_input(x);
  const int64_t rows = x.size(0), cols = x.size(1), groups = cols / kFp8Block;
  auto xf = x.to(at::kFloat).reshape({rows, groups, kFp8Block});
  auto amax = xf.abs().amax(2);
  // Times the reciprocal, as quantize_rows_e4m3_reference computes a row's.
  auto scale = at::where(amax > 0, amax * (1.f / kE4m3Max), at::ones_like(amax));
  auto data = (xf / scale.unsqueeze(2)).clamp_(-kE4m3Max, kE4m3Max).to(at::kFloat8_e4m3fn);
  return {data.reshape({rows, cols}).contiguous(), scale.t().contiguous().t()};
}

Fp8Groups quantize_groups_e4m3(const at::Tensor& x) {
  check_group_input(x);
  if (!half_precision_on_cuda(x)) return quantize_groups_e4m3_reference(x);
  const int64_t rows = x.size(0), groups = x.size(1) / kFp8Block;
  auto data = at::empty({rows, x.size(1)}, x.options().dtype(at::kFloat8_e4m3fn));
  auto storage = at::empty({groups, rows}, x.options().dtype(at::kFloat));
  quantize_groups_e4m3_cuda(x, data, storage);
  return {data, storage.t()};
}

at::Tensor dequantize_groups(const Fp8Groups& x) {
  const int64_t rows = x.data.size(0), cols = x.data.size(1);
  return (x.data.to(at::kFloat).view({rows, cols / kFp8Block, kFp8Block}) * x.scale.unsqueeze(2))
      .view({rows, cols});
}

Fp8Blocks quantize_blocks_e4m3(const at::Tensor& w) {
  if (w.dim() != 2) fail("fp8 block quantize: expected a matrix, got {}", w.sizes());
  const int64_t out = w.size(0), in = w.size(1), nb = blocks_of(out), kb = blocks_of(in);
  // Partial blocks at the edges padded with zeros, which change no block's largest magnitude.
  auto padded = at::zeros({nb * kFp8Block, kb * kFp8Block}, w.options().dtype(at::kFloat));
  padded.narrow(0, 0, out).narrow(1, 0, in).copy_(w);
  auto blocks = padded.view({nb, kFp8Block, kb, kFp8Block});
  auto amax = blocks.abs().amax({1, 3});
  auto scale = at::where(amax > 0, amax * (1.f / kE4m3Max), at::ones_like(amax));
  blocks.div_(scale.view({nb, 1, kb, 1})).clamp_(-kE4m3Max, kE4m3Max);
  auto data = padded.narrow(0, 0, out).narrow(1, 0, in).to(at::kFloat8_e4m3fn).contiguous();
  return {data, scale.contiguous()};
}

void check_blocks(const Fp8Blocks& w, const std::string& name) {
  if (w.data.dim() != 2 || w.data.scalar_type() != at::kFloat8_e4m3fn) {
    fail("{}: an FP8 block-quantised weight must be float8_e4m3fn [out, in], got {} {}", name,
         w.data.sizes(), c10::toString(w.data.scalar_type()));
  }
  const std::vector<int64_t> scales = {blocks_of(w.data.size(0)), blocks_of(w.data.size(1))};
  if (w.scale_inv.sizes().vec() != scales || w.scale_inv.scalar_type() != at::kFloat) {
    fail(
        "{}: an FP8 weight of shape {} in blocks of [{}, {}] needs an fp32 scale_inv of shape "
        "[{}], got {} {}",
        name, w.data.sizes(), kFp8Block, kFp8Block, fmt::join(scales, ", "), w.scale_inv.sizes(),
        c10::toString(w.scale_inv.scalar_type()));
  }
}

std::string fp8_block_gemm_unsupported(const Fp8Blocks& w, const std::string& name) {
  if (w.data.size(0) % kFp8Block == 0 && w.data.size(1) % kFp8Block == 0) return {};
  return fmt::format(
      "{} is {}: the block-scaled FP8 GEMM needs both sizes multiples of {} (whole blocks)", name,
      w.data.sizes(), kFp8Block);
}

at::Tensor dequantize_blocks(const Fp8Blocks& w) {
  const int64_t out = w.data.size(0), in = w.data.size(1);
  const auto s = w.scale_inv.to(at::kFloat)
                     .repeat_interleave(kFp8Block, 0)
                     .repeat_interleave(kFp8Block, 1)
                     .narrow(0, 0, out)
                     .narrow(1, 0, in);
  return w.data.to(at::kFloat) * s;
}

namespace {

void check_mm(const at::Tensor& out, const Fp8Groups& a, const Fp8Blocks& b) {
  check_groups(a);
  check_blocks(b, "fp8 block GEMM: b");
  if (auto why = fp8_block_gemm_unsupported(b, "fp8 block GEMM: b"); !why.empty()) fail("{}", why);
  const int64_t m = a.data.size(0), n = b.data.size(0);
  if (b.data.size(1) != a.data.size(1)) {
    fail("fp8 block GEMM: a {} and b {} differ in k", a.data.sizes(), b.data.sizes());
  }
  if (out.sizes() != at::IntArrayRef{m, n} || !out.is_contiguous()) {
    fail("fp8 block GEMM: out must be contiguous [{}, {}], got {}", m, n, out.sizes());
  }
}

}  // namespace

void mm_fp8_blocks_reference_out(at::Tensor& out, const Fp8Groups& a, const Fp8Blocks& b) {
  check_mm(out, a, b);
  out.copy_(at::mm(dequantize_groups(a), dequantize_blocks(b).t()));
}

void mm_fp8_blocks_out(at::Tensor& out, const Fp8Groups& a, const Fp8Blocks& b) {
  if (!fp8_block_gemm_supported(out.device())) return mm_fp8_blocks_reference_out(out, a, b);
  check_mm(out, a, b);
  if (out.scalar_type() != at::kBFloat16) {
    fail("fp8 block GEMM: block scales write bf16, out is {}", c10::toString(out.scalar_type()));
  }
  const int64_t m = a.data.size(0), scale_row = a.data.size(1) / kFp8Block;
  if (m == 0) return;
  // at::_scaled_mm takes the DeepSeek recipe's scales in one layout only, unpadded: a's
  // [m, k / 128] of strides [1, m], b^T's the transposed view of the checkpoint's [n / 128,
  // k / 128] rows; cuBLASLt reads both through 16-byte aligned leading dimensions (strides of a
  // multiple of 4 floats: CUBLAS_STATUS_NOT_SUPPORTED otherwise, seen at m = 1 on an H100).
  // linear_fp8_blocks pads m; the published models' k are multiples of 512; other shapes take
  // the reference.
  if (m % kFp8ScaleAlign != 0 || scale_row % kFp8ScaleAlign != 0) {
    return mm_fp8_blocks_reference_out(out, a, b);
  }
  // Accumulation keeps its periodic promotion to fp32.
  at::_scaled_mm_out(out, a.data, b.data.t(), a.scale, b.scale_inv.t(), std::nullopt, std::nullopt,
                     at::kBFloat16, /*use_fast_accum=*/false);
}

at::Tensor linear_fp8_blocks(const at::Tensor& x, const Fp8Blocks& w) {
  if (x.dim() != 2 || x.size(1) != w.data.size(1)) {
    fail("fp8 block linear: x {} does not match the weight {}", x.sizes(), w.data.sizes());
  }
  if (x.scalar_type() == at::kBFloat16 && fp8_block_gemm_supported(x.device())) {
    // Rows up to a multiple of kFp8ScaleAlign (the GEMM's scale alignment), zeros that no
    // output row reads.
    const int64_t m = x.size(0), rows = (m + kFp8ScaleAlign - 1) / kFp8ScaleAlign * kFp8ScaleAlign;
    at::Tensor in = x;
    if (rows != m) {
      in = at::zeros({rows, x.size(1)}, x.options());
      in.narrow(0, 0, m).copy_(x);
    }
    auto out = at::empty({rows, w.data.size(0)}, x.options());
    mm_fp8_blocks_out(out, quantize_groups_e4m3(in), w);
    return rows == m ? out : out.narrow(0, 0, m);
  }
  return at::linear(x.to(at::kFloat), dequantize_blocks(w)).to(x.scalar_type());
}

}  // namespace dflash::kernels
