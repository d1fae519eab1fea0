#include "models/hybrid_layers.h"

#include "kernels/causal_conv1d.h"
#include "kernels/gated_delta_rule.h"
#include "kernels/rotary.h"
#include "models/layers.h"

namespace dflash::models {

at::Tensor qwen3_next_in_proj(const at::Tensor& qkvz, const at::Tensor& ba,
                              const LinearAttentionShape& s) {
  const int64_t nk = s.num_key_heads, dk = s.key_head_dim, h = qkvz.size(-1);
  const int64_t r = s.num_value_heads / nk, vz = r * s.value_head_dim;
  auto g = qkvz.view({nk, 2 * dk + 2 * vz, h});
  auto gba = ba.view({nk, 2 * r, h});
  auto rows = [&](const at::Tensor& t, int64_t start, int64_t len) {
    return t.narrow(1, start, len).reshape({nk * len, h});
  };
  return at::cat({rows(g, 0, dk), rows(g, dk, dk), rows(g, 2 * dk, vz), rows(g, 2 * dk + vz, vz),
                  rows(gba, 0, r), rows(gba, r, r)});
}

std::pair<at::Tensor, at::Tensor> qwen3_next_in_proj_inverse(const at::Tensor& w_in,
                                                             const LinearAttentionShape& s) {
  const int64_t nk = s.num_key_heads, dk = s.key_head_dim, h = w_in.size(-1);
  const int64_t r = s.num_value_heads / nk, vz = r * s.value_head_dim;
  int64_t at_row = 0;
  auto next = [&](int64_t len) {
    auto t = w_in.narrow(0, at_row, nk * len).view({nk, len, h});
    at_row += nk * len;
    return t;
  };
  auto q = next(dk), k = next(dk), v = next(vz), z = next(vz), b = next(r), a = next(r);
  return {at::cat({q, k, v, z}, 1).reshape({-1, h}), at::cat({b, a}, 1).reshape({-1, h})};
}

namespace {

// The rows of `all` ([slots, ...]) for the batch's entries, and writing them back: views when
// the entries are slots 0..n-1 in order, else index_select / index_copy_ (device indices: no
// host sync, capturable).
at::Tensor gather(const at::Tensor& all, const LinearCacheStep& c) {
  return c.first_slots ? all.narrow(0, 0, c.batch->size()) : all.index_select(0, c.batch->slot_ids);
}

void scatter(const at::Tensor& all, const at::Tensor& rows, const LinearCacheStep& c) {
  if (c.first_slots) {
    all.narrow(0, 0, c.batch->size()).copy_(rows);
  } else {
    all.index_copy_(0, c.batch->slot_ids, rows);
  }
}

// The recurrent form's states after each of the S tokens, [n, S, ...]: the block buffer itself
// when it holds exactly these (slots 0..n-1, S = its length: a captured verify pass writes
// them in place), else a new tensor that keep_states copies out.
at::Tensor per_token_states(const at::Tensor& state, const at::Tensor& block,
                            const LinearCacheStep& c) {
  if (block.defined() && c.first_slots && block.size(1) == c.steps) {
    return block.narrow(0, 0, c.batch->size());
  }
  auto sizes = state.sizes().vec();
  sizes[0] = c.batch->size();
  sizes.insert(sizes.begin() + 1, c.steps);
  return at::empty(sizes, state.options());
}

// With block states kept, the block buffer receives every token's state and the slot state
// stays the pre-block one until KVCache::crop commits the accepted length's; else the slot
// state becomes the one after the entry's last token.
void keep_states(const at::Tensor& state, const at::Tensor& block, const at::Tensor& states,
                 const LinearCacheStep& c) {
  if (!block.defined()) {
    scatter(state, states.select(1, c.steps - 1), c);
  } else if (!states.is_alias_of(block)) {
    scatter(block.narrow(1, 0, c.steps), states, c);
  }
}

}  // namespace

at::Tensor gated_delta_net(const at::Tensor& proj, const LinearAttentionWeights& w,
                           const LinearAttentionShape& s, double eps, const at::Tensor& cu_seqlens,
                           c10::ArrayRef<int64_t> lengths, const LinearCacheStep* cache) {
  const int64_t t = proj.size(0), conv_dim = s.conv_dim(), vd = s.value_dim();
  const int64_t nv = s.num_value_heads, dv = s.value_head_dim;
  const bool recurrent = cache != nullptr && cache->steps > 0;
  const int64_t n = cache != nullptr ? cache->batch->size() : 0,
                steps = recurrent ? cache->steps : 0;
  auto conv_in = proj.narrow(1, 0, conv_dim);
  at::Tensor mixed;
  if (recurrent) {
    const at::Tensor block = cache->keep_block ? cache->state.conv_block : at::Tensor();
    auto states = per_token_states(cache->state.conv, block, *cache);
    mixed = kernels::causal_conv1d_silu_step(conv_in.reshape({n, steps, conv_dim}), w.conv,
                                             gather(cache->state.conv, *cache), states)
                .view({t, conv_dim});
    keep_states(cache->state.conv, block, states, *cache);
  } else if (cache != nullptr) {
    auto r = kernels::causal_conv1d_silu(conv_in, w.conv, cu_seqlens, lengths,
                                         gather(cache->state.conv, *cache));
    scatter(cache->state.conv, r.final_state, *cache);
    mixed = r.out;
  } else {
    mixed = kernels::causal_conv1d_silu(conv_in, w.conv, cu_seqlens, lengths).out;
  }
  auto z = proj.narrow(1, conv_dim, vd);
  auto b = proj.narrow(1, conv_dim + vd, nv);
  auto a = proj.narrow(1, conv_dim + vd + nv, nv);
  auto q = mixed.narrow(1, 0, s.key_dim()).view({t, s.num_key_heads, s.key_head_dim});
  auto k = mixed.narrow(1, s.key_dim(), s.key_dim()).view({t, s.num_key_heads, s.key_head_dim});
  auto v = mixed.narrow(1, 2 * s.key_dim(), vd).view({t, nv, dv});
  // In fp32 whatever the compute dtype, as transformers (A_log.float(), a.float()).
  auto g =
      -w.a_log.to(at::kFloat).exp() * at::softplus(a.to(at::kFloat) + w.dt_bias.to(at::kFloat));
  auto beta = b.sigmoid();
  at::Tensor o;
  if (recurrent) {
    // The recurrent form over [n, S]: transformers' torch_recurrent_gated_delta_rule.
    auto split = [&](const at::Tensor& rows) {
      auto sizes = rows.sizes().vec();
      sizes[0] = steps;
      sizes.insert(sizes.begin(), n);
      return rows.view(sizes);
    };
    const at::Tensor block = cache->keep_block ? cache->state.recurrent_block : at::Tensor();
    auto states = per_token_states(cache->state.recurrent, block, *cache);
    o = kernels::recurrent_gated_delta_rule(split(q), split(k), split(v), split(g), split(beta),
                                            gather(cache->state.recurrent, *cache), states)
            .view({t, nv, dv});
    keep_states(cache->state.recurrent, block, states, *cache);
  } else if (cache != nullptr) {
    auto r = kernels::chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens, lengths,
                                             gather(cache->state.recurrent, *cache));
    scatter(cache->state.recurrent, r.final_state, *cache);
    o = r.out;
  } else {
    o = kernels::chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens, lengths).out;
  }
  // Qwen3NextRMSNormGated: normalised in fp32, rounded to the input dtype, times w, times
  // silu(z) in fp32, rounded again.
  auto of = o.to(at::kFloat);
  auto normed = (of * at::rsqrt(of.pow(2).mean(-1, true) + eps)).to(o.scalar_type()) * w.norm;
  auto gated = (normed * at::silu(z.view({t, nv, dv}).to(at::kFloat))).to(o.scalar_type());
  return gated.view({t, vd});
}

at::Tensor partial_rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t rd = cos.size(-1), d = x.size(-1);
  if (rd == d) return kernels::rotary(x, cos, sin);
  return at::cat({kernels::rotary(x.narrow(-1, 0, rd), cos, sin), x.narrow(-1, rd, d - rd)}, -1);
}

at::Tensor norm_weight_from_file(const at::Tensor& w) {
  return (w.to(at::kFloat) + 1.0).to(w.scalar_type());
}

at::Tensor norm_weight_to_file(const at::Tensor& w) {
  return (w.to(at::kFloat) - 1.0).to(w.scalar_type());
}

at::Tensor shared_expert(const at::Tensor& x, const at::Tensor& w_gate_up, const at::Tensor& w_down,
                         const at::Tensor& gate) {
  return at::sigmoid(at::linear(x, gate)) * swiglu_mlp(x, w_gate_up, w_down);
}

}  // namespace dflash::models
