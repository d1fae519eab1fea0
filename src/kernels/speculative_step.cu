// place_blocks: one thread per block token. greedy_verdicts: one thread block; its threads copy
// the tokens, then one thread per slot walks its block (B <= a few dozen) for the accepted
// prefix and advances the slot.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>

#include "kernels/float_cast.cuh"
#include "kernels/speculative_step.h"

namespace dflash::kernels {
namespace {

constexpr int kThreads = 256;

__global__ void place_blocks_kernel(const int64_t* __restrict__ starts,
                                    const int64_t* __restrict__ offsets,
                                    const int64_t* __restrict__ base_rows, int64_t total, int bs,
                                    int64_t* __restrict__ positions, int64_t* __restrict__ rows,
                                    int* __restrict__ seen, int* __restrict__ token_seen,
                                    int* __restrict__ block_seen, const int64_t* __restrict__ last,
                                    int64_t* __restrict__ tokens) {
  for (int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; t < total;
       t += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = t / bs, start = starts[i];
    const int64_t position = start + offsets[t];
    positions[t] = position;
    rows[t] = base_rows[t] + position;
    const int slot_seen = static_cast<int>(start + bs);
    if (t % bs == 0) {
      seen[i] = slot_seen;
      if (last != nullptr) tokens[t] = last[i];
    }
    if (token_seen != nullptr) {
      token_seen[t] = static_cast<int>(position + 1);
      block_seen[t] = slot_seen;
    }
  }
}

__global__ void greedy_verdicts_kernel(const int64_t* __restrict__ tokens,
                                       const int64_t* __restrict__ choices, int64_t n, int bs,
                                       int64_t* __restrict__ verdicts, int64_t* __restrict__ last,
                                       int64_t* __restrict__ length, int64_t* __restrict__ active,
                                       int64_t context, int64_t* __restrict__ room,
                                       const int64_t* __restrict__ stops, int64_t n_stops) {
  for (int64_t t = threadIdx.x; t < n * bs; t += blockDim.x) verdicts[t] = tokens[t];
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const int64_t* block = tokens + i * bs;
    const int64_t* choice = choices + i * bs;
    int64_t accepted = 0;
    while (accepted < bs - 1 && block[accepted + 1] == choice[accepted]) ++accepted;
    const int64_t bonus = choice[accepted];
    verdicts[n * bs + i] = accepted;
    verdicts[n * bs + n + i] = bonus;
    if (room != nullptr && active[i] != 0) {
      int64_t left = room[i];
      bool finished = false;
      for (int64_t k = 0; k <= accepted && !finished; ++k) {
        const int64_t c = k < accepted ? block[k + 1] : bonus;
        for (int64_t s = 0; s < n_stops && !finished; ++s) finished = c == stops[s];
        finished = finished || --left <= 0;
      }
      room[i] = left;
      if (finished) active[i] = 0;
    }
    if (length != nullptr) {
      const int64_t grown = length[i] + accepted + 1;
      length[i] = (grown < context ? grown : context) * active[i];
      last[i] = bonus * active[i];
    }
  }
}

}  // namespace

void place_blocks_cuda(const at::Tensor& starts, const at::Tensor& offsets,
                       const at::Tensor& base_rows, const BlockPlacement& out,
                       const at::Tensor& last, const at::Tensor& tokens) {
  const c10::cuda::CUDAGuard guard(starts.device());
  const auto stream = c10::cuda::getCurrentCUDAStream(starts.device().index());
  const int64_t total = offsets.size(0);
  const int bs = static_cast<int>(total / starts.size(0));
  auto int_ptr = [](const at::Tensor& t) { return t.defined() ? t.data_ptr<int>() : nullptr; };
  place_blocks_kernel<<<grid_stride_blocks(total, kThreads), kThreads, 0, stream>>>(
      starts.data_ptr<int64_t>(), offsets.data_ptr<int64_t>(), base_rows.data_ptr<int64_t>(), total,
      bs, out.positions.data_ptr<int64_t>(), out.rows.data_ptr<int64_t>(), out.seen.data_ptr<int>(),
      int_ptr(out.token_seen), int_ptr(out.block_seen),
      last.defined() ? last.data_ptr<int64_t>() : nullptr,
      tokens.defined() ? tokens.data_ptr<int64_t>() : nullptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void greedy_verdicts_cuda(const at::Tensor& tokens, const at::Tensor& choices, int64_t block,
                          const SlotAdvance* advance, at::Tensor& verdicts) {
  const c10::cuda::CUDAGuard guard(tokens.device());
  const auto stream = c10::cuda::getCurrentCUDAStream(tokens.device().index());
  const int64_t n = tokens.size(0) / block;
  greedy_verdicts_kernel<<<1, kThreads, 0, stream>>>(
      tokens.data_ptr<int64_t>(), choices.data_ptr<int64_t>(), n, static_cast<int>(block),
      verdicts.data_ptr<int64_t>(), advance ? advance->last.data_ptr<int64_t>() : nullptr,
      advance ? advance->length.data_ptr<int64_t>() : nullptr,
      advance ? advance->active.data_ptr<int64_t>() : nullptr, advance ? advance->context : 0,
      advance && advance->room.defined() ? advance->room.data_ptr<int64_t>() : nullptr,
      advance && advance->room.defined() ? advance->stops.data_ptr<int64_t>() : nullptr,
      advance && advance->room.defined() ? advance->stops.numel() : 0);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace dflash::kernels
