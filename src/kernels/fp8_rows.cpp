#include "kernels/fp8_rows.h"

#include <ATen/cuda/CUDAContext.h>
#include <fmt/ranges.h>

#include "common/error.h"
#include "kernels/cluster_linear.h"
#include "kernels/wgmma_linear.h"

namespace dflash::kernels {

void quantize_rows_e4m3_cuda(at::TensorList parts, at::Tensor& data,
                             at::Tensor& scale);  // fp8_rows.cu
void quantize_columns_e4m3_cuda(at::TensorList parts, at::Tensor& amax, at::Tensor& data,
                                at::Tensor& scale);  // fp8_columns.cu

namespace {

// Whether the CUDA kernels take these parts: one CUDA device, bf16 or fp16.
bool half_precision_on_cuda(at::TensorList parts) {
  for (const at::Tensor& t : parts) {
    if (!t.is_cuda() || t.device() != parts[0].device() ||
        t.scalar_type() != parts[0].scalar_type() ||
        (t.scalar_type() != at::kBFloat16 && t.scalar_type() != at::kHalf)) {
      return false;
    }
  }
  return true;
}

void check_rows(const Fp8Rows& x, const char* name) {
  if (x.data.dim() != 2 || x.data.scalar_type() != at::kFloat8_e4m3fn || !x.data.is_contiguous()) {
    fail("fp8 GEMM: {} must be contiguous float8_e4m3fn [rows, cols], got {} {}", name,
         x.data.sizes(), c10::toString(x.data.scalar_type()));
  }
  if (x.scale.sizes() != at::IntArrayRef{x.data.size(0)} || x.scale.scalar_type() != at::kFloat) {
    fail("fp8 GEMM: {}'s scale must be fp32 [{}], got {} {}", name, x.data.size(0), x.scale.sizes(),
         c10::toString(x.scale.scalar_type()));
  }
}

void check_mm(const at::Tensor& out, const Fp8Rows& a, const Fp8Rows& b) {
  check_rows(a, "a");
  check_rows(b, "b");
  const int64_t m = a.data.size(0), n = b.data.size(0), k = a.data.size(1);
  if (b.data.size(1) != k) {
    fail("fp8 GEMM: a {} and b {} differ in k", a.data.sizes(), b.data.sizes());
  }
  if (k % 16 != 0) fail("fp8 GEMM: k = {} must be a multiple of 16", k);
  if (out.sizes() != at::IntArrayRef{m, n} || !out.is_contiguous()) {
    fail("fp8 GEMM: out must be contiguous [{}, {}], got {}", m, n, out.sizes());
  }
}

}  // namespace

Fp8Rows quantize_rows_e4m3_reference(const at::Tensor& x) {
  if (x.dim() != 2) fail("fp8 quantize: expected a matrix, got {}", x.sizes());
  auto xf = x.to(at::kFloat);
  auto amax = xf.abs().amax(1);
  // Times the reciprocal, as ATen's CUDA division by a scalar computes it and the kernel does.
  auto scale = at::where(amax > 0, amax * (1.f / kE4m3Max), at::ones_like(amax));
  // Clamped before the cast: values past the largest finite e4m3 would become NaN.
  auto data = (xf / scale.unsqueeze(1)).clamp_(-kE4m3Max, kE4m3Max).to(at::kFloat8_e4m3fn);
  return {data.contiguous(), scale.contiguous()};
}

Fp8Rows quantize_rows_e4m3(at::TensorList parts) {
  if (parts.empty()) fail("fp8 quantize: no matrix given");
  int64_t cols = 0;
  for (const at::Tensor& t : parts) {
    if (t.dim() != 2 || t.size(0) != parts[0].size(0)) {
      fail("fp8 quantize: parts must be matrices of {} rows, got {}", parts[0].sizes(), t.sizes());
    }
    cols += t.size(1);
  }
  if (!half_precision_on_cuda(parts))
    return quantize_rows_e4m3_reference(parts.size() == 1 ? parts[0] : at::cat(parts, 1));
  // The kernel takes four parts and rows of unit column stride (a transposed view is copied).
  if (parts.size() > 4) return quantize_rows_e4m3(at::cat(parts, 1));
  std::vector<at::Tensor> dense;
  for (const at::Tensor& t : parts) dense.push_back(t.stride(1) == 1 ? t : t.contiguous());
  Fp8Rows out{at::empty({parts[0].size(0), cols}, parts[0].options().dtype(at::kFloat8_e4m3fn)),
              at::empty({parts[0].size(0)}, parts[0].options().dtype(at::kFloat))};
  quantize_rows_e4m3_cuda(dense, out.data, out.scale);
  return out;
}

Fp8Rows quantize_columns_e4m3(at::TensorList parts) {
  if (parts.empty()) fail("fp8 quantize: no matrix given");
  int64_t rows = 0;
  for (const at::Tensor& t : parts) {
    if (t.dim() != 2 || t.size(1) != parts[0].size(1)) {
      fail("fp8 quantize: stacked parts must be matrices of {} columns, got {}", parts[0].sizes(),
           t.sizes());
    }
    rows += t.size(0);
  }
  const int64_t cols = parts[0].size(1);
  if (rows == 0) {  // all-zero columns: scale 1, as the reference gives an all-zero row
    return {at::empty({cols, 0}, parts[0].options().dtype(at::kFloat8_e4m3fn)),
            at::ones({cols}, parts[0].options().dtype(at::kFloat))};
  }
  if (!half_precision_on_cuda(parts)) {
    return quantize_rows_e4m3_reference(parts.size() == 1 ? parts[0].t() : at::cat(parts, 0).t());
  }
  // The kernel takes four parts and rows of unit column stride (a transposed view is copied).
  if (parts.size() > 4) return quantize_columns_e4m3(at::cat(parts, 0));
  std::vector<at::Tensor> dense;
  for (const at::Tensor& t : parts) dense.push_back(t.stride(1) == 1 ? t : t.contiguous());
  auto amax = at::zeros({cols}, parts[0].options().dtype(at::kInt));
  Fp8Rows out{at::empty({cols, rows}, parts[0].options().dtype(at::kFloat8_e4m3fn)),
              at::empty({cols}, parts[0].options().dtype(at::kFloat))};
  quantize_columns_e4m3_cuda(dense, amax, out.data, out.scale);
  return out;
}

Fp8Rows quantize_rows_e4m3(const at::Tensor& x) { return quantize_rows_e4m3(at::TensorList(x)); }

at::Tensor dequantize_rows(const Fp8Rows& x) {
  return x.data.to(at::kFloat) * x.scale.unsqueeze(1);
}

bool fp8_gemm_supported(at::Device device) {
  if (!device.is_cuda()) return false;
  const auto* props = at::cuda::getDeviceProperties(device.index() < 0 ? 0 : device.index());
  return props->major >= 9;
}

std::string fp8_gemm_unsupported(at::Device device, at::ScalarType dtype) {
  if (!device.is_cuda()) return {};
  if (!fp8_gemm_supported(device)) {
    return fmt::format("{} is older than compute capability 9.0 (Hopper)", device.str());
  }
  if (dtype != at::kBFloat16) {
    return fmt::format("it writes bf16 rows and the compute dtype is {}", c10::toString(dtype));
  }
  return {};
}

void mm_fp8_rows_reference_out(at::Tensor& out, const Fp8Rows& a, const Fp8Rows& b) {
  check_mm(out, a, b);
  out.copy_(at::mm(dequantize_rows(a), dequantize_rows(b).t()));
}

void mm_fp8_rows_out(at::Tensor& out, const Fp8Rows& a, const Fp8Rows& b) {
  if (!fp8_gemm_supported(out.device())) return mm_fp8_rows_reference_out(out, a, b);
  check_mm(out, a, b);
  if (out.scalar_type() != at::kBFloat16) {
    fail("fp8 GEMM: row-wise scales write bf16, out is {}", c10::toString(out.scalar_type()));
  }
  if (a.data.size(0) == 0) return;
  // A speculative block's few rows: cuBLASLt would run a 128-row tile for them.
  if (wgmma_linear_e4m3_enabled() && wgmma_linear_e4m3_fits(a, b)) {
    return wgmma_linear_e4m3_out(out, a, b);
  }
  if (cluster_linear_enabled() && cluster_linear_fits(a, b)) return cluster_linear_out(out, a, b);
  // b^T is column-major as cuBLASLt wants the second operand; row-wise scales are [m, 1] and
  // [1, n]. Accumulation keeps its periodic promotion to fp32 (no fast accumulation): k runs
  // to the vocabulary size.
  at::_scaled_mm_out(out, a.data, b.data.t(), a.scale.unsqueeze(1), b.scale.unsqueeze(0),
                     std::nullopt, std::nullopt, at::kBFloat16, /*use_fast_accum=*/false);
}

}  // namespace dflash::kernels
