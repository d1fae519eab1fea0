#include "kernels/speculative_step.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "common/error.h"

namespace dflash::kernels {

// speculative_step.cu
void place_blocks_cuda(const at::Tensor& starts, const at::Tensor& offsets,
                       const at::Tensor& base_rows, const BlockPlacement& out,
                       const at::Tensor& last, const at::Tensor& tokens);
void greedy_verdicts_cuda(const at::Tensor& tokens, const at::Tensor& choices, int64_t block,
                          const SlotAdvance* advance, at::Tensor& verdicts);

namespace {

// A contiguous vector of `dtype` and `size` on ref's device, or a failure naming it.
void check_vector(const char* op, const char* name, const at::Tensor& t, at::ScalarType dtype,
                  int64_t size, const at::Tensor& ref) {
  if (t.scalar_type() != dtype || t.dim() != 1 || t.size(0) != size || !t.is_contiguous() ||
      t.device() != ref.device()) {
    fail("{}: {} must be contiguous {} [{}] on {}, got {} {} on {}", op, name, c10::toString(dtype),
         size, ref.device().str(), c10::toString(t.scalar_type()), t.sizes(), t.device().str());
  }
}

void check_long(const char* op, const char* name, const at::Tensor& t, int64_t size,
                const at::Tensor& ref) {
  check_vector(op, name, t, at::kLong, size, ref);
}

void check_int(const char* op, const char* name, const at::Tensor& t, int64_t size,
               const at::Tensor& ref) {
  check_vector(op, name, t, at::kInt, size, ref);
}

void check_placement(const at::Tensor& starts, const at::Tensor& offsets,
                     const at::Tensor& base_rows, const BlockPlacement& out, const at::Tensor& last,
                     const at::Tensor& tokens) {
  const char* op = "place_blocks";
  const int64_t n = starts.dim() == 1 ? starts.size(0) : 0;
  if (n == 0 || offsets.dim() != 1 || offsets.size(0) % n != 0) {
    fail("place_blocks: starts must be [n] and offsets [n*B], got {} and {}", starts.sizes(),
         offsets.sizes());
  }
  const int64_t total = offsets.size(0);
  check_long(op, "starts", starts, n, starts);
  check_long(op, "offsets", offsets, total, starts);
  check_long(op, "base_rows", base_rows, total, starts);
  check_long(op, "positions", out.positions, total, starts);
  check_long(op, "rows", out.rows, total, starts);
  check_int(op, "seen", out.seen, n, starts);
  if (out.token_seen.defined() != out.block_seen.defined()) {
    fail("place_blocks: token_seen and block_seen come together");
  }
  if (out.token_seen.defined()) {
    check_int(op, "token_seen", out.token_seen, total, starts);
    check_int(op, "block_seen", out.block_seen, total, starts);
  }
  if (last.defined() != tokens.defined()) fail("place_blocks: last and tokens come together");
  if (last.defined()) {
    check_long(op, "last", last, n, starts);
    check_long(op, "tokens", tokens, total, starts);
  }
}

}  // namespace

void place_blocks_reference(const at::Tensor& starts, const at::Tensor& offsets,
                            const at::Tensor& base_rows, const BlockPlacement& out,
                            const at::Tensor& last, const at::Tensor& tokens) {
  const int64_t n = starts.size(0), bs = offsets.size(0) / n;
  auto positions = starts.unsqueeze(1).expand({n, bs}).reshape(-1) + offsets;
  out.positions.copy_(positions);
  at::Tensor rows = out.rows;  // a handle: add_out writes the caller's tensor
  at::add_out(rows, base_rows, positions);
  out.seen.copy_(starts + bs);
  if (out.token_seen.defined()) {
    out.token_seen.copy_(positions + 1);
    out.block_seen.copy_(out.seen.unsqueeze(1).expand({n, bs}).reshape(-1));
  }
  if (last.defined()) tokens.view({n, bs}).select(1, 0).copy_(last);
}

void place_blocks(const at::Tensor& starts, const at::Tensor& offsets, const at::Tensor& base_rows,
                  const BlockPlacement& out, const at::Tensor& last, const at::Tensor& tokens) {
  check_placement(starts, offsets, base_rows, out, last, tokens);
  if (!starts.is_cuda()) {
    place_blocks_reference(starts, offsets, base_rows, out, last, tokens);
    return;
  }
  place_blocks_cuda(starts, offsets, base_rows, out, last, tokens);
}

at::Tensor greedy_verdicts_reference(const at::Tensor& tokens, const at::Tensor& choices,
                                     int64_t block, const SlotAdvance* advance) {
  const int64_t n = tokens.size(0) / block, bs = block;
  auto b = tokens.view({n, bs}), c = choices.view({n, bs});
  auto accepted = b.narrow(1, 1, bs - 1).eq(c.narrow(1, 0, bs - 1)).to(at::kLong).cumprod(1).sum(1);
  auto bonus = c.gather(1, accepted.unsqueeze(1)).squeeze(1);
  if (advance != nullptr && advance->room.defined()) {
    // The walk of each active slot's committed tokens, on the host (the reference's job is to
    // be plain).
    auto acc = accepted.cpu(), block_tokens = b.cpu(), bon = bonus.cpu();
    auto room = advance->room.cpu(), active = advance->active.cpu(), stops = advance->stops.cpu();
    const int64_t* stop = stops.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) {
      if (active[i].item<int64_t>() == 0) continue;
      const int64_t a = acc[i].item<int64_t>();
      int64_t left = room[i].item<int64_t>();
      bool finished = false;
      for (int64_t k = 0; k <= a && !finished; ++k) {
        const int64_t c = k < a ? block_tokens[i][k + 1].item<int64_t>() : bon[i].item<int64_t>();
        finished = std::find(stop, stop + stops.numel(), c) != stop + stops.numel() || --left <= 0;
      }
      room[i] = left;
      if (finished) active[i] = 0;
    }
    advance->room.copy_(room);
    advance->active.copy_(active);
  }
  if (advance != nullptr) {
    advance->length.copy_((advance->length + accepted + 1).clamp_max_(advance->context) *
                          advance->active);
    advance->last.copy_(bonus * advance->active);
  }
  return at::cat({tokens, accepted, bonus});
}

at::Tensor greedy_verdicts(const at::Tensor& tokens, const at::Tensor& choices, int64_t block,
                           const SlotAdvance* advance) {
  const char* op = "greedy_verdicts";
  const int64_t total = tokens.dim() == 1 ? tokens.size(0) : -1;
  if (block < 2 || total <= 0 || total % block != 0) {
    fail("greedy_verdicts: tokens must be [n*B] with blocks of B >= 2, got {} with B = {}",
         tokens.sizes(), block);
  }
  const int64_t n = total / block;
  check_long(op, "tokens", tokens, total, tokens);
  check_long(op, "choices", choices, total, tokens);
  if (advance != nullptr) {
    check_long(op, "last", advance->last, n, tokens);
    check_long(op, "length", advance->length, n, tokens);
    check_long(op, "active", advance->active, n, tokens);
    if (advance->room.defined()) {
      check_long(op, "room", advance->room, n, tokens);
      const int64_t k = advance->stops.defined() ? advance->stops.numel() : -1;
      if (k >= 0) check_long(op, "stops", advance->stops, k, tokens);
      if (k < 0) fail("greedy_verdicts: room comes with stops (int64 [k], k >= 0)");
    }
  }
  if (!tokens.is_cuda()) return greedy_verdicts_reference(tokens, choices, block, advance);
  auto verdicts = at::empty({total + 2 * n}, tokens.options());
  greedy_verdicts_cuda(tokens, choices, block, advance, verdicts);
  return verdicts;
}

}  // namespace dflash::kernels
