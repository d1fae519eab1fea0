// kernel_bench: kernels/cudnn_attention's causal forward, the prefill's causal attention at one
// 2048-token sequence (q and k contiguous, as the q/k norm + rotary kernel writes them; v a
// strided slice of the fused QKV output): ATen's cuDNN call (what it replaces), ours through
// the same cuDNN graph (what the prefill runs; the same bits, printed), and flash's. Each
// validated against ATen's cuDNN output. Also the host's microseconds to issue one call, which the
// prefill's host thread spends per layer. TFLOP/s counts the causal half of QK^T and PV.
#include <c10/cuda/CUDAStream.h>
#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <functional>

#include "kernel_bench/bench.h"
#include "kernels/cudnn_attention.h"

namespace dflash::kernel_bench {

void bench_prefill_attention(const Bench& b) {
  const models::ModelConfig& c = b.config;
  const at::TensorOptions opts = b.opts;
  const int64_t d = c.head_dim;
  const int64_t len = 2048, hq = c.num_heads, hkv = c.num_kv_heads;
  auto qkv = at::randn({len, (hq + 2 * hkv) * d}, opts);
  auto qx = at::randn({len, hq, d}, opts), kx = at::randn({len, hkv, d}, opts);
  auto vx = qkv.narrow(1, (hq + hkv) * d, hkv * d).view({len, hkv, d});
  const double flops = 2.0 * 2.0 * hq * d * len * (len + 1) / 2.0;
  const double bytes = 2.0 * (2 * qx.numel() + 2 * kx.numel());
  auto bhld = [&](const at::Tensor& t) { return t.view({1, len, t.size(1), d}).transpose(1, 2); };
  const auto cu =
      at::tensor(std::vector<int32_t>{0, static_cast<int32_t>(len)}, at::kInt).to(b.device);
  // Each call with the tolerance of its validation against ATen's cuDNN output: another bf16
  // kernel's probabilities and sums in another order (flash's), 1/16 of the largest.
  const std::vector<std::tuple<std::string, std::function<at::Tensor()>, double>> calls = {
      {"prefill attention, aten cudnn",
       [&] {
         return std::get<0>(at::_scaled_dot_product_cudnn_attention(bhld(qx), bhld(kx), bhld(vx),
                                                                    std::nullopt, false, 0.0,
                                                                    /*is_causal=*/true, false))
             .transpose(1, 2)
             .reshape({len, hq, d});
       },
       kBitwise},
      {"prefill attention, ours (cudnn)",
       [&] {
         return kernels::cudnn_causal_attention_forward(qx, kx, vx, 1,
                                                        1.0 / std::sqrt(static_cast<double>(d)));
       },
       1.0 / 16},
      {"prefill attention, flash",
       [&] {
         return std::get<0>(at::_flash_attention_forward(qx, kx, vx, cu, cu, len, len, 0.0,
                                                         /*is_causal=*/true,
                                                         /*return_debug_mask=*/false));
       },
       1.0 / 16}};
  const auto aten = std::get<1>(calls[0])();
  for (const auto& [name, call, rtol] : calls) {
    const double us = b.eager_us([&] { call(); });
    // Host time: calls issued behind a long GEMM queue, so none waits for the GPU.
    auto big = at::randn({8192, 8192}, opts);
    for (int i = 0; i < 8; ++i) at::mm(big, big);
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 10; ++i) call();
    const double host_us =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() /
        10;
    at::cuda::getCurrentCUDAStream().synchronize();
    b.report(name, len, len, d, us, bytes);
    const auto out = call();
    fmt::print("{}: {:.1f} TFLOP/s, host {:.1f} us a call, {} ATen's cuDNN output\n", name,
               flops / us / 1e6, host_us, at::equal(out, aten) ? "bitwise" : "not bitwise");
    b.check(name + " vs ATen's cuDNN", out, aten, rtol);
  }
}

}  // namespace dflash::kernel_bench
