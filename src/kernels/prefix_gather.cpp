#include "kernels/prefix_gather.h"

#include <torch/csrc/autograd/custom_function.h>

#include <bit>
#include <utility>

#include "common/error.h"
#include "common/upload.h"

namespace dflash::kernels {

// prefix_gather.cu
void prefix_gather_backward_cuda(const at::Tensor& grad, const PrefixGatherPlan& plan,
                                 at::Tensor& out);
void prefix_gather_backward_accumulate_cuda(const at::Tensor& grad, const PrefixGatherPlan& plan,
                                            at::Tensor& context, const at::Tensor& block);

int64_t gathered_capacity(int64_t keys) {
  if (keys < 16) return keys;
  const int64_t step = int64_t{1} << (std::bit_width(static_cast<uint64_t>(keys)) - 1 - 3);
  return (keys + step - 1) / step * step;
}

PrefixGatherPlan PrefixGatherPlan::build(const std::vector<int64_t>& lengths,
                                         const std::vector<int64_t>& sequence,
                                         const std::vector<int64_t>& anchors, int64_t block_size,
                                         at::Device device, const std::vector<int64_t>& begins) {
  const int64_t n = static_cast<int64_t>(anchors.size());
  const int64_t num_seqs = static_cast<int64_t>(lengths.size());
  if (static_cast<int64_t>(sequence.size()) != n) fail("prefix gather: sequence/anchor sizes");
  if (!begins.empty() && static_cast<int64_t>(begins.size()) != n) {
    fail("prefix gather: {} begins for {} blocks", begins.size(), n);
  }
  std::vector<int64_t> row_start(num_seqs + 1, 0), block_start(num_seqs + 1, 0);
  for (int64_t s = 0; s < num_seqs; ++s) row_start[s + 1] = row_start[s] + lengths[s];
  PrefixGatherPlan plan;
  plan.context_rows = row_start.back();
  if (plan.context_rows > INT32_MAX) fail("prefix gather: more than 2^31 context rows");
  plan.block_size = block_size;
  plan.blocks = n;
  std::vector<int32_t> cu_k(n + 1, 0), context_start(n + 1), context_length(n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t s = sequence[i], begin = begins.empty() ? 0 : begins[i];
    if (s < 0 || s >= num_seqs || (i > 0 && s < sequence[i - 1])) {
      fail("prefix gather: blocks must be grouped by sequence in order (block {})", i);
    }
    if (anchors[i] < 0 || anchors[i] >= lengths[s]) {
      fail("prefix gather: anchor {} of block {} outside its sequence of length {}", anchors[i], i,
           lengths[s]);
    }
    if (begin < 0 || begin > anchors[i]) {
      fail("prefix gather: begin {} of block {} outside [0, anchor {}]", begin, i, anchors[i]);
    }
    block_start[s + 1] = i + 1;
    context_start[i] = static_cast<int32_t>(row_start[s] + begin);
    context_length[i] = static_cast<int32_t>(anchors[i] - begin);
    plan.max_context = std::max<int64_t>(plan.max_context, context_length[i]);
    const int64_t keys = context_length[i] + block_size;
    plan.key_lengths.push_back(keys);
    plan.max_keys = std::max(plan.max_keys, keys);
    if (cu_k[i] + keys > INT32_MAX) fail("prefix gather: more than 2^31 gathered keys");
    cu_k[i + 1] = static_cast<int32_t>(cu_k[i] + keys);
  }
  for (int64_t s = 0; s < num_seqs; ++s)
    block_start[s + 1] = std::max(block_start[s + 1], block_start[s]);
  plan.keys = cu_k.back();
  plan.capacity = gathered_capacity(plan.keys);
  if (plan.capacity > INT32_MAX) fail("prefix gather: more than 2^31 gathered keys");
  // The padding rows form one more segment, of block id n, so every index tensor below has the
  // capacity's fixed size.
  std::vector<int64_t> lens_padded = plan.key_lengths;
  lens_padded.push_back(plan.capacity - plan.keys);
  auto lens = upload_to(device, at::tensor(lens_padded, at::kLong));
  plan.cu_keys = upload_to(device, at::tensor(cu_k, at::kInt));
  plan.seq_row_start = upload_to(device, at::tensor(row_start, at::kLong));
  plan.seq_block_start = upload_to(device, at::tensor(block_start, at::kLong));
  context_start[n] = static_cast<int32_t>(plan.context_rows);
  plan.context_start = upload_to(device, at::tensor(context_start, at::kInt));
  plan.context_length = upload_to(device, at::tensor(context_length, at::kInt));
  // The index on the device, no host loop over keys: block id and offset of every key. The
  // padding segment (block n) reads context_start[n] = T and length 0; its rows are zeroed.
  auto block = at::repeat_interleave(at::arange(n + 1, lens.options()), lens, 0, plan.capacity);
  auto offset =
      at::arange(plan.capacity, lens.options()) - plan.cu_keys.to(at::kLong).index_select(0, block);
  auto length = at::cat({plan.context_length, at::zeros({1}, plan.context_length.options())})
                    .to(at::kLong)
                    .index_select(0, block);
  auto index =
      at::where(offset < length, plan.context_start.to(at::kLong).index_select(0, block) + offset,
                plan.context_rows + block * block_size + (offset - length));
  plan.index = at::where(block < n, index, at::zeros({}, index.options()));
  return plan;
}

at::Tensor prefix_gather_backward_reference(const at::Tensor& grad, const PrefixGatherPlan& plan) {
  const int64_t rows = plan.context_rows + plan.blocks * plan.block_size;
  auto out = at::zeros({rows, grad.size(1)}, grad.options().dtype(at::kFloat));
  out.index_add_(0, plan.index.narrow(0, 0, plan.keys),
                 grad.narrow(0, 0, plan.keys).to(at::kFloat));
  return out.to(grad.scalar_type());
}

namespace {

// The kernel moves 16-byte vectors: a tensor's base and its rows must be 16-byte aligned.
bool vector_aligned(const at::Tensor& t) {
  return !t.defined() || (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 &&
                          (t.size(-1) * t.element_size()) % 16 == 0);
}

}  // namespace

at::Tensor prefix_gather_backward(const at::Tensor& grad, const PrefixGatherPlan& plan) {
  if (grad.dim() != 2 || grad.size(0) != plan.index.size(0)) {
    fail("prefix gather backward: gradient {} does not fit the plan's {} keys", grad.sizes(),
         plan.index.size(0));
  }
  if (plan.index.device() != grad.device()) {
    fail("prefix gather backward: gradient on {}, plan on {}", grad.device().str(),
         plan.index.device().str());
  }
  auto g = grad.contiguous();
  if (!g.is_cuda() || !vector_aligned(g)) return prefix_gather_backward_reference(g, plan);
  const int64_t rows = plan.context_rows + plan.blocks * plan.block_size;
  auto out = at::empty({rows, grad.size(1)}, grad.options());
  if (rows > 0 && g.size(1) > 0) prefix_gather_backward_cuda(g, plan, out);
  return out;
}

void prefix_gather_backward_accumulate(const at::Tensor& grad, const PrefixGatherPlan& plan,
                                       at::Tensor& context, const at::Tensor& block) {
  const int64_t width = grad.dim() == 2 ? grad.size(1) : -1;
  const int64_t block_rows = plan.blocks * plan.block_size;
  if (grad.dim() != 2 || grad.size(0) != plan.index.size(0) ||
      context.sizes() != at::IntArrayRef{plan.context_rows, width} ||
      context.scalar_type() != at::kFloat || !context.is_contiguous() ||
      (block_rows > 0 && (!block.defined() || block.sizes() != at::IntArrayRef{block_rows, width} ||
                          block.scalar_type() != grad.scalar_type() || !block.is_contiguous()))) {
    fail(
        "prefix gather backward: gradient {}, context {}, block {} do not fit the plan ({} keys, "
        "{} context rows, {} block rows; fp32 context, contiguous)",
        grad.sizes(), context.sizes(), block.defined() ? block.sizes() : at::IntArrayRef{},
        plan.index.size(0), plan.context_rows, block_rows);
  }
  auto g = grad.contiguous();
  if (g.is_cuda() && vector_aligned(g) && vector_aligned(context) && vector_aligned(block) &&
      plan.index.device() == g.device()) {
    if (context.numel() + block_rows > 0) {
      prefix_gather_backward_accumulate_cuda(g, plan, context, block);
    }
    return;
  }
  auto r = prefix_gather_backward(g, plan);
  context.add_(r.narrow(0, 0, plan.context_rows));
  if (block_rows > 0) block.copy_(r.narrow(0, plan.context_rows, block_rows));
}

namespace {

// The plan's fields that travel through an autograd context, by name.
constexpr std::pair<const char*, at::Tensor PrefixGatherPlan::*> kSavedTensors[] = {
    {"index", &PrefixGatherPlan::index},
    {"cu_keys", &PrefixGatherPlan::cu_keys},
    {"seq_row_start", &PrefixGatherPlan::seq_row_start},
    {"seq_block_start", &PrefixGatherPlan::seq_block_start},
    {"context_start", &PrefixGatherPlan::context_start},
    {"context_length", &PrefixGatherPlan::context_length}};
constexpr std::pair<const char*, int64_t PrefixGatherPlan::*> kSavedSizes[] = {
    {"context_rows", &PrefixGatherPlan::context_rows},
    {"block_size", &PrefixGatherPlan::block_size},
    {"blocks", &PrefixGatherPlan::blocks},
    {"max_keys", &PrefixGatherPlan::max_keys},
    {"max_context", &PrefixGatherPlan::max_context},
    {"keys", &PrefixGatherPlan::keys},
    {"capacity", &PrefixGatherPlan::capacity}};

}  // namespace

void PrefixGatherPlan::save(torch::autograd::AutogradContext* ctx,
                            const std::string& prefix) const {
  for (const auto& [name, field] : kSavedTensors) ctx->saved_data[prefix + name] = this->*field;
  for (const auto& [name, field] : kSavedSizes) ctx->saved_data[prefix + name] = this->*field;
}

PrefixGatherPlan PrefixGatherPlan::saved(torch::autograd::AutogradContext* ctx,
                                         const std::string& prefix) {
  PrefixGatherPlan plan;
  for (const auto& [name, field] : kSavedTensors) {
    plan.*field = ctx->saved_data[prefix + name].toTensor();
  }
  for (const auto& [name, field] : kSavedSizes) {
    plan.*field = ctx->saved_data[prefix + name].toInt();
  }
  return plan;
}

namespace {

struct PrefixGatherFunction : public torch::autograd::Function<PrefixGatherFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& rows,
                            const PrefixGatherPlan& plan) {
    plan.save(ctx);
    auto out = at::empty({plan.capacity, rows.size(1)}, rows.options());
    auto segments = out.narrow(0, 0, plan.keys);
    at::index_select_out(segments, rows, 0, plan.index.narrow(0, 0, plan.keys));
    out.narrow(0, plan.keys, plan.capacity - plan.keys).zero_();
    return out;
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    return {prefix_gather_backward(grads[0], PrefixGatherPlan::saved(ctx)), at::Tensor()};
  }
};

}  // namespace

at::Tensor prefix_gather(const at::Tensor& rows, const PrefixGatherPlan& plan) {
  const int64_t expected = plan.context_rows + plan.blocks * plan.block_size;
  if (rows.dim() != 2 || rows.size(0) != expected) {
    fail("prefix gather: rows {} do not fit the plan ({} context + {} block rows)", rows.sizes(),
         plan.context_rows, expected - plan.context_rows);
  }
  return PrefixGatherFunction::apply(rows, plan);
}

}  // namespace dflash::kernels
