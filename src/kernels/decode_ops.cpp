#include "kernels/decode_ops.h"

#include <array>

#include "common/error.h"
#include "kernels/rotary.h"
#include "kernels/swiglu.h"

namespace dflash::kernels {

// decode_ops.cu
void add_rms_norm_cuda(const at::Tensor& x, const at::Tensor& y, const at::Tensor& weight,
                       double eps, at::Tensor& sum, at::Tensor& normed);
void qk_norm_rotary_cuda(const at::Tensor& qkv, const at::Tensor& q_norm, const at::Tensor& k_norm,
                         const at::Tensor& cos, const at::Tensor& sin, double eps, at::Tensor& q,
                         at::Tensor& k, at::Tensor* v, const at::Tensor* rows, bool q_group_major);
void write_kv_rows_cuda(at::Tensor& keys, at::Tensor& values, const at::Tensor& rows,
                        const at::Tensor& k, const at::Tensor& v);

namespace {

void check_same(const char* op, const at::Tensor& ref, std::initializer_list<at::Tensor> others) {
  for (const at::Tensor& t : others) {
    if (t.scalar_type() != ref.scalar_type() || t.device() != ref.device()) {
      fail("{}: every input must be {} on {}, got {} on {}", op, c10::toString(ref.scalar_type()),
           ref.device().str(), c10::toString(t.scalar_type()), t.device().str());
    }
  }
}

void check_add_rms_norm(const at::Tensor& x, const at::Tensor& y, const at::Tensor& weight) {
  if (x.dim() != 2 || y.sizes() != x.sizes() || weight.dim() != 1 || weight.size(0) != x.size(1)) {
    fail("add_rms_norm: x and y must be [T, H] and weight [H], got {}, {} and {}", x.sizes(),
         y.sizes(), weight.sizes());
  }
  check_same("add_rms_norm", x, {y, weight});
}

void check_qk_norm_rotary(const at::Tensor& qkv, int64_t q_heads, int64_t kv_heads,
                          const at::Tensor& q_norm, const at::Tensor& k_norm, const at::Tensor& cos,
                          const at::Tensor& sin, bool q_group_major = false) {
  const int64_t d = q_norm.dim() == 1 ? q_norm.size(0) : 0;
  if (q_heads < 0 || kv_heads <= 0 || d <= 0 || d % 2 != 0 || qkv.dim() != 2 ||
      qkv.size(1) != (q_heads + 2 * kv_heads) * d || k_norm.sizes() != q_norm.sizes()) {
    fail(
        "qk_norm_rotary: qkv must be [T, (Hq + 2 Hkv) D] with Hq = {}, Hkv = {} and an even "
        "D = q_norm's size; got qkv {}, q_norm {}, k_norm {}",
        q_heads, kv_heads, qkv.sizes(), q_norm.sizes(), k_norm.sizes());
  }
  if (q_group_major && q_heads % kv_heads != 0) {
    fail("qk_norm_rotary: group-major q needs Hq ({}) a multiple of Hkv ({})", q_heads, kv_heads);
  }
  const std::array<int64_t, 2> table{qkv.size(0), d};
  if (cos.sizes() != at::IntArrayRef(table) || sin.sizes() != at::IntArrayRef(table)) {
    fail("qk_norm_rotary: cos/sin must be [{}, {}], got {} and {}", qkv.size(0), d, cos.sizes(),
         sin.sizes());
  }
  check_same("qk_norm_rotary", qkv, {q_norm, k_norm, cos, sin});
}

// keys, values: [R, Hkv, D] contiguous caches of ref's dtype and device; rows: int64 [T] there.
void check_cache(const char* op, const at::Tensor& ref, int64_t tokens, int64_t kv_heads, int64_t d,
                 const at::Tensor& keys, const at::Tensor& values, const at::Tensor& rows) {
  if (keys.dim() != 3 || keys.size(1) != kv_heads || keys.size(2) != d ||
      values.sizes() != keys.sizes() || !keys.is_contiguous() || !values.is_contiguous()) {
    fail("{}: keys and values must be contiguous [R, {}, {}], got {} and {}", op, kv_heads, d,
         keys.sizes(), values.sizes());
  }
  if (rows.dim() != 1 || rows.size(0) != tokens || rows.scalar_type() != at::kLong ||
      rows.device() != ref.device()) {
    fail("{}: rows must be int64 [{}] on {}, got {} [{}] on {}", op, tokens, ref.device().str(),
         c10::toString(rows.scalar_type()), rows.sizes(), rows.device().str());
  }
  check_same(op, ref, {keys, values});
}

void check_write_kv_rows(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& rows,
                         const at::Tensor& k, const at::Tensor& v) {
  if (k.dim() != 3 || v.sizes() != k.sizes()) {
    fail("write_kv_rows: k and v must be [T, Hkv, D] alike, got {} and {}", k.sizes(), v.sizes());
  }
  check_cache("write_kv_rows", k, k.size(0), k.size(1), k.size(2), keys, values, rows);
  check_same("write_kv_rows", k, {v});
}

void check_silu_mul(const at::Tensor& gate_up) {
  if (gate_up.dim() != 2 || gate_up.size(1) % 2 != 0) {
    fail("silu_mul: gate_up must be [T, 2F], got {}", gate_up.sizes());
  }
}

bool on_cuda_half(const at::Tensor& t) {
  return t.is_cuda() && (t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf);
}

}  // namespace

AddRmsNorm add_rms_norm_reference(const at::Tensor& x, const at::Tensor& y,
                                  const at::Tensor& weight, double eps) {
  check_add_rms_norm(x, y, weight);
  auto sum = (x.to(at::kFloat) + y.to(at::kFloat)).to(x.scalar_type());
  auto normed = at::rms_norm(sum.to(at::kFloat), {x.size(1)}, weight.to(at::kFloat), eps);
  return {sum, normed.to(x.scalar_type())};
}

AddRmsNorm add_rms_norm(const at::Tensor& x, const at::Tensor& y, const at::Tensor& weight,
                        double eps) {
  if (!on_cuda_half(x)) return add_rms_norm_reference(x, y, weight, eps);
  check_add_rms_norm(x, y, weight);
  AddRmsNorm out{at::empty_like(x, at::MemoryFormat::Contiguous),
                 at::empty_like(x, at::MemoryFormat::Contiguous)};
  if (x.numel() > 0) {
    add_rms_norm_cuda(x.contiguous(), y.contiguous(), weight.contiguous(), eps, out.sum,
                      out.normed);
  }
  return out;
}

std::pair<at::Tensor, at::Tensor> qk_norm_rotary_reference(
    const at::Tensor& qkv, int64_t q_heads, int64_t kv_heads, const at::Tensor& q_norm,
    const at::Tensor& k_norm, const at::Tensor& cos, const at::Tensor& sin, double eps) {
  check_qk_norm_rotary(qkv, q_heads, kv_heads, q_norm, k_norm, cos, sin);
  const int64_t t = qkv.size(0), d = q_norm.size(0);
  auto c = cos.to(at::kFloat), s = sin.to(at::kFloat);
  auto one = [&](int64_t first_head, int64_t heads, const at::Tensor& weight) {
    auto x = qkv.narrow(1, first_head * d, heads * d).reshape({t, heads, d}).to(at::kFloat);
    auto normed = at::rms_norm(x, {d}, weight.to(at::kFloat), eps);
    return rotary_reference(normed, c, s).to(qkv.scalar_type());
  };
  return {one(0, q_heads, q_norm), one(q_heads, kv_heads, k_norm)};
}

std::pair<at::Tensor, at::Tensor> qk_norm_rotary(const at::Tensor& qkv, int64_t q_heads,
                                                 int64_t kv_heads, const at::Tensor& q_norm,
                                                 const at::Tensor& k_norm, const at::Tensor& cos,
                                                 const at::Tensor& sin, double eps) {
  if (!on_cuda_half(qkv)) {
    return qk_norm_rotary_reference(qkv, q_heads, kv_heads, q_norm, k_norm, cos, sin, eps);
  }
  check_qk_norm_rotary(qkv, q_heads, kv_heads, q_norm, k_norm, cos, sin);
  const int64_t t = qkv.size(0), d = q_norm.size(0);
  auto q = at::empty({t, q_heads, d}, qkv.options());
  auto k = at::empty({t, kv_heads, d}, qkv.options());
  if (t > 0) {
    qk_norm_rotary_cuda(qkv.stride(1) == 1 ? qkv : qkv.contiguous(), q_norm.contiguous(),
                        k_norm.contiguous(), cos.contiguous(), sin.contiguous(), eps, q, k, nullptr,
                        nullptr, /*q_group_major=*/false);
  }
  return {q, k};
}

at::Tensor qk_norm_rotary_into_cache_reference(const at::Tensor& qkv, int64_t q_heads,
                                               int64_t kv_heads, const at::Tensor& q_norm,
                                               const at::Tensor& k_norm, const at::Tensor& cos,
                                               const at::Tensor& sin, double eps, at::Tensor keys,
                                               at::Tensor values, const at::Tensor& rows,
                                               bool q_group_major) {
  check_qk_norm_rotary(qkv, q_heads, kv_heads, q_norm, k_norm, cos, sin, q_group_major);
  auto [q, k] = qk_norm_rotary_reference(qkv, q_heads, kv_heads, q_norm, k_norm, cos, sin, eps);
  if (q_group_major) {
    q = q.view({q.size(0), kv_heads, q_heads / kv_heads, q.size(2)})
            .transpose(1, 2)
            .reshape({q.size(0), q_heads, q.size(2)});
  }
  const int64_t d = q_norm.size(0);
  check_cache("qk_norm_rotary_into_cache", qkv, qkv.size(0), kv_heads, d, keys, values, rows);
  keys.index_copy_(0, rows, k);
  values.index_copy_(
      0, rows, qkv.narrow(1, (q_heads + kv_heads) * d, kv_heads * d).reshape({-1, kv_heads, d}));
  return q;
}

at::Tensor qk_norm_rotary_into_cache(const at::Tensor& qkv, int64_t q_heads, int64_t kv_heads,
                                     const at::Tensor& q_norm, const at::Tensor& k_norm,
                                     const at::Tensor& cos, const at::Tensor& sin, double eps,
                                     at::Tensor keys, at::Tensor values, const at::Tensor& rows,
                                     bool q_group_major) {
  if (!on_cuda_half(qkv)) {
    return qk_norm_rotary_into_cache_reference(qkv, q_heads, kv_heads, q_norm, k_norm, cos, sin,
                                               eps, std::move(keys), std::move(values), rows,
                                               q_group_major);
  }
  check_qk_norm_rotary(qkv, q_heads, kv_heads, q_norm, k_norm, cos, sin, q_group_major);
  const int64_t t = qkv.size(0), d = q_norm.size(0);
  check_cache("qk_norm_rotary_into_cache", qkv, qkv.size(0), kv_heads, d, keys, values, rows);
  auto q = at::empty({t, q_heads, d}, qkv.options());
  if (t > 0) {
    const at::Tensor packed_rows = rows.contiguous();
    qk_norm_rotary_cuda(qkv.stride(1) == 1 ? qkv : qkv.contiguous(), q_norm.contiguous(),
                        k_norm.contiguous(), cos.contiguous(), sin.contiguous(), eps, q, keys,
                        &values, &packed_rows, q_group_major);
  }
  return q;
}

void write_kv_rows_reference(at::Tensor keys, at::Tensor values, const at::Tensor& rows,
                             const at::Tensor& k, const at::Tensor& v) {
  check_write_kv_rows(keys, values, rows, k, v);
  keys.index_copy_(0, rows, k);
  values.index_copy_(0, rows, v);
}

void write_kv_rows(at::Tensor keys, at::Tensor values, const at::Tensor& rows, const at::Tensor& k,
                   const at::Tensor& v) {
  if (!on_cuda_half(k)) return write_kv_rows_reference(keys, values, rows, k, v);
  check_write_kv_rows(keys, values, rows, k, v);
  if (k.numel() == 0) return;
  // The kernel reads each token's heads as one run of Hkv * D elements.
  auto packed = [](const at::Tensor& t) {
    return t.stride(2) == 1 && t.stride(1) == t.size(2) ? t : t.contiguous();
  };
  write_kv_rows_cuda(keys, values, rows.contiguous(), packed(k), packed(v));
}

at::Tensor silu_mul_reference(const at::Tensor& gate_up) {
  check_silu_mul(gate_up);
  const int64_t f = gate_up.size(1) / 2;
  return swiglu_forward_reference(gate_up.narrow(1, 0, f), gate_up.narrow(1, f, f));
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_silu_mul(gate_up);
  const int64_t f = gate_up.size(1) / 2;
  return swiglu_forward(gate_up.narrow(1, 0, f), gate_up.narrow(1, f, f));
}

}  // namespace dflash::kernels
