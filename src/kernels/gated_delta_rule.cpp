#include "kernels/gated_delta_rule.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/upload.h"
#include "kernels/autograd_records.h"

namespace dflash::kernels {

// gated_delta_rule.cu
int64_t chunk_gated_delta_scratch_floats(int64_t chunk_heads, bool tensor_cores);
void chunk_gated_delta_rule_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& g, const at::Tensor& beta,
                                 const at::Tensor& table, int64_t chunks, int64_t sequences,
                                 bool tensor_cores, at::Tensor& scratch,
                                 const at::Tensor& initial_state, at::Tensor& out,
                                 at::Tensor& final_state);
void recurrent_gated_delta_rule_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const at::Tensor& g, const at::Tensor& beta,
                                     const at::Tensor& state, at::Tensor& out,
                                     const at::Tensor& states_out);

namespace {

constexpr int64_t kChunk = 64;

// The shapes both forms share, named by the caller's layout. `lead` is the number of leading
// token dimensions: 1 for packed [T, H, D], 2 for [N, S, H, D].
struct Dims {
  int64_t hk, hv, dk, dv;
};

Dims check_qkv(const char* what, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
               const at::Tensor& g, const at::Tensor& beta, int64_t lead) {
  const int64_t rank = lead + 2;
  if (q.dim() != rank || k.sizes() != q.sizes() || v.dim() != rank) {
    fail("{}: q and k must be alike of rank {} and v of rank {}, got q {} k {} v {}", what, rank,
         rank, q.sizes(), k.sizes(), v.sizes());
  }
  for (int64_t d = 0; d < lead; ++d) {
    if (v.size(d) != q.size(d))
      fail("{}: v {} and q {} disagree on tokens", what, v.sizes(), q.sizes());
  }
  const Dims dims{q.size(lead), v.size(lead), q.size(lead + 1), v.size(lead + 1)};
  if (dims.hk <= 0 || dims.hv % dims.hk != 0) {
    fail("{}: value heads ({}) must be a multiple of key heads ({})", what, dims.hv, dims.hk);
  }
  auto token_heads = v.sizes().slice(0, lead + 1).vec();
  if (g.sizes() != c10::IntArrayRef(token_heads) || beta.sizes() != c10::IntArrayRef(token_heads)) {
    fail("{}: g and beta must be {}, got {} and {}", what, token_heads, g.sizes(), beta.sizes());
  }
  if (k.scalar_type() != q.scalar_type() || !q.is_floating_point() || !v.is_floating_point()) {
    fail("{}: q and k must share a floating dtype, v floating, got {} {} {}", what,
         c10::toString(q.scalar_type()), c10::toString(k.scalar_type()),
         c10::toString(v.scalar_type()));
  }
  for (const auto* t : {&k, &v, &g, &beta}) {
    if (t->device() != q.device())
      fail("{}: every operand must be on q's device {}", what, q.device().str());
  }
  return dims;
}

void check_state(const char* what, const char* name, const at::Tensor& s, c10::IntArrayRef expected,
                 const at::Device& device) {
  if (s.sizes() != expected || s.scalar_type() != at::kFloat || s.device() != device) {
    fail("{}: {} must be float32 {} on {}, got {} {} on {}", what, name, expected, device.str(),
         c10::toString(s.scalar_type()), s.sizes(), s.device().str());
  }
}

// x * rsqrt(sum x^2 + 1e-6) over the last dimension, as transformers' l2norm (and FLA).
at::Tensor l2norm(const at::Tensor& x) { return x * at::rsqrt((x * x).sum(-1, true) + 1e-6); }

// Sequences of a packed batch side by side, [T, ...] rows <-> an [N, L, ...] grid (L a
// multiple of the chunk): `to_grid` holds, for each grid cell, the packed row it takes (T, a
// zero row, past a sequence's end), `from_grid` the cell of each packed row. Gathers, not
// in-place copies, so autograd sees the whole batch as a few ops.
struct Grid {
  int64_t n = 0, len = 0;
  at::Tensor to_grid, from_grid;

  Grid(c10::ArrayRef<int64_t> lengths, int64_t total, int64_t multiple, const at::Device& device)
      : n(static_cast<int64_t>(lengths.size())) {
    for (int64_t l : lengths) len = std::max(len, (l + multiple - 1) / multiple * multiple);
    std::vector<int64_t> to(n * len, total), from;
    from.reserve(total);
    int64_t start = 0;
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t p = 0; p < lengths[i]; ++p) {
        to[i * len + p] = start + p;
        from.push_back(i * len + p);
      }
      start += lengths[i];
    }
    to_grid = upload_to(device, at::tensor(to, at::kLong));
    from_grid = upload_to(device, at::tensor(from, at::kLong));
  }

  // x [T, ...] -> [N, L, ...], zeros past each sequence's end.
  at::Tensor gather(const at::Tensor& x) const {
    auto rows = at::cat({x, at::zeros_like(x.narrow(0, 0, 1))}).index_select(0, to_grid);
    auto sizes = x.sizes().vec();
    sizes[0] = len;
    sizes.insert(sizes.begin(), n);
    return rows.view(sizes);
  }

  // y [N, L, ...] -> [T, ...].
  at::Tensor scatter(const at::Tensor& y) const {
    auto sizes = y.sizes().vec();
    sizes.erase(sizes.begin());
    sizes[0] = n * len;
    return y.reshape(sizes).index_select(0, from_grid);
  }
};

// [N, L, H, D] (any dtype) -> [N, Hv, L, D] fp32, key heads repeated for their value heads.
at::Tensor heads_first(const at::Tensor& x, int64_t repeat) {
  auto t = x.to(at::kFloat).transpose(1, 2);
  return (repeat > 1 ? t.repeat_interleave(repeat, 1) : t).contiguous();
}

// All sequences at once, zero-padded to chunks: q, k [N, Hv, L, Dk] (normalised, q scaled),
// v [N, Hv, L, Dv], g, beta [N, Hv, L], state [N, Hv, Dk, Dv], all fp32. Zero padding at a
// sequence's end (g 0: no decay, beta 0: no write) leaves its state unchanged. Returns out
// [N, Hv, L, Dv] and advances `state`: transformers' torch_chunk_gated_delta_rule step by step.
at::Tensor chunk_sequences(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor g, at::Tensor beta,
                           at::Tensor& state) {
  const int64_t n = q.size(0), h = q.size(1), len = q.size(2), dk = q.size(3), dv = v.size(3);
  const int64_t chunks = len / kChunk;
  q = q.view({n, h, chunks, kChunk, dk});
  k = k.view({n, h, chunks, kChunk, dk});
  v = v.view({n, h, chunks, kChunk, dv});
  beta = beta.view({n, h, chunks, kChunk, 1});
  g = g.view({n, h, chunks, kChunk});
  auto v_beta = v * beta, k_beta = k * beta;
  auto upper = at::ones({kChunk, kChunk}, q.options().dtype(at::kBool)).triu(1);
  auto cum = g.cumsum(-1);
  auto pairwise = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, -INFINITY).exp();
  auto ut = at::matmul(k_beta, k.transpose(-1, -2)) * pairwise;
  auto intra = at::matmul(q, k.transpose(-1, -2)) * pairwise;
  auto decayed_k_beta = k_beta * cum.exp().unsqueeze(-1);
  auto new_values = at::linalg_solve_triangular(ut, v_beta, /*upper=*/false, /*left=*/true,
                                                /*unitriangular=*/true);
  auto k_cumdecay = at::linalg_solve_triangular(ut, decayed_k_beta, false, true, true);
  auto q_decayed = q * cum.exp().unsqueeze(-1);
  auto k_decayed = k * (cum.narrow(-1, kChunk - 1, 1) - cum).exp().unsqueeze(-1);
  auto chunk_decay = cum.select(-1, kChunk - 1).exp();  // [n, h, chunks]
  std::vector<at::Tensor> out;
  for (int64_t c = 0; c < chunks; ++c) {
    auto v_new = new_values.select(2, c) - at::matmul(k_cumdecay.select(2, c), state);
    out.push_back(at::matmul(q_decayed.select(2, c), state) +
                  at::matmul(intra.select(2, c), v_new));
    state = state * chunk_decay.select(2, c).view({n, h, 1, 1}) +
            at::matmul(k_decayed.select(2, c).transpose(-1, -2), v_new);
  }
  return at::stack(out, 2).view({n, h, len, dv});
}

Dims check_chunk(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                 const at::Tensor& beta, const at::Tensor& cu_seqlens,
                 c10::ArrayRef<int64_t> lengths, const at::Tensor& initial_state) {
  constexpr const char* what = "chunk_gated_delta_rule";
  const auto d = check_qkv(what, q, k, v, g, beta, 1);
  const int64_t n = static_cast<int64_t>(lengths.size());
  int64_t total = 0;
  for (int64_t len : lengths) {
    if (len < 0) fail("{}: negative sequence length in {}", what, lengths);
    total += len;
  }
  if (total != q.size(0))
    fail("{}: lengths {} sum to {}, q has {} tokens", what, lengths, total, q.size(0));
  if (cu_seqlens.dim() != 1 || cu_seqlens.size(0) != n + 1 ||
      cu_seqlens.scalar_type() != at::kInt || cu_seqlens.device() != q.device()) {
    fail("{}: cu_seqlens must be int32 [{}] on q's device, got {} {} on {}", what, n + 1,
         c10::toString(cu_seqlens.scalar_type()), cu_seqlens.sizes(), cu_seqlens.device().str());
  }
  if (initial_state.defined()) {
    check_state(what, "initial_state", initial_state, {n, d.hv, d.dk, d.dv}, q.device());
  }
  return d;
}

Dims check_recurrent(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& g, const at::Tensor& beta, const at::Tensor& state,
                     const at::Tensor& states_out) {
  constexpr const char* what = "recurrent_gated_delta_rule";
  const auto d = check_qkv(what, q, k, v, g, beta, 2);
  const int64_t n = q.size(0), steps = q.size(1);
  check_state(what, "state", state, {n, d.hv, d.dk, d.dv}, q.device());
  if (states_out.defined()) {
    check_state(what, "states_out", states_out, {n, steps, d.hv, d.dk, d.dv}, q.device());
  }
  return d;
}

// The kernels' case: heads of 128 on CUDA, q, k and v of one dtype (bf16, fp16 or fp32).
bool on_cuda_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const auto dtype = q.scalar_type();
  return q.is_cuda() && q.size(-1) == 128 && v.size(-1) == 128 && k.scalar_type() == dtype &&
         v.scalar_type() == dtype &&
         (dtype == at::kBFloat16 || dtype == at::kHalf || dtype == at::kFloat);
}

// [T, H, 128] with unit stride inside each token (a column slice of a wider row qualifies).
at::Tensor token_rows(const at::Tensor& t) {
  return t.stride(2) == 1 && t.stride(1) == t.size(2) ? t : t.contiguous();
}

// The tensor-core kernels copy token rows 16 bytes at a time: a row start off that grid (a view
// at an odd column offset) gets an aligned copy.
at::Tensor aligned_rows(const at::Tensor& t) {
  const bool aligned = reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 &&
                       (t.stride(0) * t.element_size()) % 16 == 0;
  return aligned ? t : t.clone(at::MemoryFormat::Contiguous);
}

bool use_tensor_cores(ChunkKernel kernel) {
  if (kernel != ChunkKernel::kAuto) return kernel == ChunkKernel::kTensorCore;
  const char* env = std::getenv("DFLASH_GDN_KERNEL");
  const std::string name = env ? env : "tc";
  if (name != "tc" && name != "simt")
    fail("chunk_gated_delta_rule: DFLASH_GDN_KERNEL must be tc or simt, got '{}'", name);
  return name == "tc";
}

}  // namespace

GatedDeltaResult chunk_gated_delta_rule_reference(const at::Tensor& q, const at::Tensor& k,
                                                  const at::Tensor& v, const at::Tensor& g,
                                                  const at::Tensor& beta,
                                                  const at::Tensor& cu_seqlens,
                                                  c10::ArrayRef<int64_t> lengths,
                                                  const at::Tensor& initial_state) {
  const auto d = check_chunk(q, k, v, g, beta, cu_seqlens, lengths, initial_state);
  const int64_t n = static_cast<int64_t>(lengths.size());
  const int64_t repeat = d.hv / d.hk;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d.dk));
  auto state = initial_state.defined()
                   ? initial_state
                   : at::zeros({n, d.hv, d.dk, d.dv}, q.options().dtype(at::kFloat));
  const Grid grid(lengths, q.size(0), kChunk, q.device());
  if (grid.len == 0) return {at::empty({q.size(0), d.hv, d.dv}, v.options()), state.clone()};
  auto per_head = [&](const at::Tensor& x) {  // [T, Hv] -> [N, Hv, L] fp32
    return grid.gather(x.to(at::kFloat)).transpose(1, 2).contiguous();
  };
  auto qs = l2norm(heads_first(grid.gather(q), repeat)) * scale;
  auto ks = l2norm(heads_first(grid.gather(k), repeat));
  auto o =
      chunk_sequences(qs, ks, heads_first(grid.gather(v), 1), per_head(g), per_head(beta), state);
  return {grid.scatter(o.transpose(1, 2)).to(v.scalar_type()), state};
}

at::Tensor recurrent_gated_delta_rule_reference(const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& v, const at::Tensor& g,
                                                const at::Tensor& beta, const at::Tensor& state,
                                                const at::Tensor& states_out) {
  const auto d = check_recurrent(q, k, v, g, beta, state, states_out);
  const int64_t n = q.size(0), steps = q.size(1);
  const int64_t repeat = d.hv / d.hk;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d.dk));
  auto qs = l2norm(heads_first(q, repeat)) * scale, ks = l2norm(heads_first(k, repeat));
  auto vs = heads_first(v, 1);
  auto decay = g.to(at::kFloat).exp(), bs = beta.to(at::kFloat);  // [N, S, Hv]
  auto s = state.clone();
  auto out = at::empty({n, steps, d.hv, d.dv}, v.options());
  for (int64_t t = 0; t < steps; ++t) {
    auto q_t = qs.select(2, t), k_t = ks.select(2, t), v_t = vs.select(2, t);  // [N, Hv, D]
    s = s * decay.select(1, t).unsqueeze(-1).unsqueeze(-1);
    auto kv_mem = (s * k_t.unsqueeze(-1)).sum(-2);
    auto delta = (v_t - kv_mem) * bs.select(1, t).unsqueeze(-1);
    s = s + k_t.unsqueeze(-1) * delta.unsqueeze(-2);
    out.select(1, t).copy_((s * q_t.unsqueeze(-1)).sum(-2));
    if (states_out.defined()) states_out.select(1, t).copy_(s);
  }
  return out;
}

GatedDeltaResult chunk_gated_delta_rule(const at::Tensor& q, const at::Tensor& k,
                                        const at::Tensor& v, const at::Tensor& g,
                                        const at::Tensor& beta, const at::Tensor& cu_seqlens,
                                        c10::ArrayRef<int64_t> lengths,
                                        const at::Tensor& initial_state, ChunkKernel kernel) {
  if (!on_cuda_kernel(q, k, v) || autograd_records({q, k, v, g, beta, initial_state})) {
    return chunk_gated_delta_rule_reference(q, k, v, g, beta, cu_seqlens, lengths, initial_state);
  }
  const auto d = check_chunk(q, k, v, g, beta, cu_seqlens, lengths, initial_state);
  const int64_t n = static_cast<int64_t>(lengths.size());
  auto out = at::empty({q.size(0), d.hv, d.dv}, v.options());
  auto final_state = at::empty({n, d.hv, d.dk, d.dv}, q.options().dtype(at::kFloat));
  if (n == 0) return {out, final_state};
  // Per chunk (first token, rows), then per sequence (first token, length, first chunk): the
  // kernels' work list, from the host lengths (no read of cu_seqlens back from the device).
  std::vector<int32_t> chunk_part, seq_part;
  int64_t start = 0, chunks = 0;
  for (int64_t len : lengths) {
    seq_part.insert(seq_part.end(), {int32_t(start), int32_t(len), int32_t(chunks)});
    for (int64_t c = 0; c < len; c += kChunk, ++chunks) {
      chunk_part.insert(chunk_part.end(), {int32_t(start + c), int32_t(std::min(kChunk, len - c))});
    }
    start += len;
  }
  if (start > std::numeric_limits<int32_t>::max())
    fail("chunk_gated_delta_rule: {} tokens exceed int32", start);
  chunk_part.insert(chunk_part.end(), seq_part.begin(), seq_part.end());
  // Pinned and asynchronous: no wait for the GPU on the host (the caching host allocator keeps
  // the pinned block until the copy has run).
  auto table = upload_to(q.device(), at::tensor(chunk_part, at::kInt));
  const bool tc = use_tensor_cores(kernel);
  auto rows = [&](const at::Tensor& t) { return tc ? aligned_rows(token_rows(t)) : token_rows(t); };
  auto scratch = at::empty({chunk_gated_delta_scratch_floats(chunks * d.hv, tc)},
                           q.options().dtype(at::kFloat));
  chunk_gated_delta_rule_cuda(rows(q), rows(k), rows(v), g.to(at::kFloat).contiguous(),
                              beta.to(at::kFloat).contiguous(), table, chunks, n, tc, scratch,
                              initial_state.defined() ? initial_state.contiguous() : at::Tensor(),
                              out, final_state);
  return {out, final_state};
}

at::Tensor recurrent_gated_delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& g, const at::Tensor& beta,
                                      const at::Tensor& state, const at::Tensor& states_out) {
  if (!on_cuda_kernel(q, k, v) || autograd_records({q, k, v, g, beta, state})) {
    return recurrent_gated_delta_rule_reference(q, k, v, g, beta, state, states_out);
  }
  const auto d = check_recurrent(q, k, v, g, beta, state, states_out);
  auto out = at::empty({q.size(0), q.size(1), d.hv, d.dv}, v.options());
  if (out.numel() == 0) return out;
  // The kernel writes states_out in place: a non-contiguous one gets a contiguous copy back.
  auto states = !states_out.defined() || states_out.is_contiguous()
                    ? states_out
                    : at::empty_like(states_out, at::MemoryFormat::Contiguous);
  recurrent_gated_delta_rule_cuda(q.contiguous(), k.contiguous(), v.contiguous(),
                                  g.to(at::kFloat).contiguous(), beta.to(at::kFloat).contiguous(),
                                  state.contiguous(), out, states);
  if (states.defined() && !states.is_same(states_out)) states_out.copy_(states);
  return out;
}

}  // namespace dflash::kernels
