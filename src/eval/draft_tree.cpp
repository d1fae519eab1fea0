#include "eval/draft_tree.h"

#include <cmath>
#include <queue>

#include "common/error.h"

namespace dflash::eval {

std::vector<int64_t> DraftTree::walk(std::span<const int64_t> choices) const {
  std::vector<int64_t> path;
  int64_t node = 0;
  for (;;) {
    int64_t next = -1;
    for (int64_t c = node + 1; c < size() && next < 0; ++c) {
      if (parents[c] == node && tokens[c] == choices[node]) next = c;
    }
    if (next < 0) return path;
    path.push_back(next);
    node = next;
  }
}

DraftTree build_draft_tree(int64_t root_token, const at::Tensor& probs, const at::Tensor& tokens,
                           int64_t budget) {
  if (probs.dim() != 2 || tokens.sizes() != probs.sizes() || !probs.device().is_cpu() ||
      !tokens.device().is_cpu()) {
    fail("draft tree: probs and tokens must be CPU [positions, K] alike, got [{}] and [{}]",
         fmt::join(probs.sizes(), ", "), fmt::join(tokens.sizes(), ", "));
  }
  if (budget < 1) fail("draft tree: the node budget must be positive, got {}", budget);
  const auto p = probs.to(at::kDouble).contiguous();
  const auto t = tokens.to(at::kLong).contiguous();
  const int64_t positions = p.size(0), k = p.size(1);
  const double* pp = p.data_ptr<double>();
  const int64_t* tt = t.data_ptr<int64_t>();
  DraftTree tree{{root_token}, {-1}, {0}};
  // A frontier candidate: token `rank` of position `position` under node `parent`, whose path
  // scores `parent_score`.
  struct Candidate {
    double score, parent_score;
    int64_t parent, position, rank;
    uint64_t order;  // when it joined the frontier
    bool operator<(const Candidate& o) const {
      return score != o.score ? score < o.score : order > o.order;
    }
  };
  std::priority_queue<Candidate> frontier;
  uint64_t joined = 0;
  auto offer = [&](double parent_score, int64_t parent, int64_t position, int64_t rank) {
    if (position >= positions || rank >= k) return;
    const double prob = pp[position * k + rank];
    if (!(prob > 0)) return;  // zero (or NaN): never a node
    frontier.push({parent_score + std::log(prob), parent_score, parent, position, rank, joined++});
  };
  offer(0.0, 0, 0, 0);
  while (tree.size() - 1 < budget && !frontier.empty()) {
    const Candidate c = frontier.top();
    frontier.pop();
    const int64_t node = tree.size();
    tree.tokens.push_back(tt[c.position * k + c.rank]);
    tree.parents.push_back(c.parent);
    tree.depths.push_back(c.position + 1);
    offer(c.score, node, c.position + 1, 0);
    offer(c.parent_score, c.parent, c.position, c.rank + 1);
  }
  return tree;
}

}  // namespace dflash::eval
