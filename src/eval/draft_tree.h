// eval: generation and speculative decoding with the target and drafter. This file: the draft
// tree of tree verification (DDTree, Ringel et al. 2026, arXiv 2604.12989). A block diffusion
// drafter gives, in one pass, a distribution for each of the next B-1 positions; instead of
// verifying only the most likely token at each, the decoder verifies a tree of continuations
// under a node budget in one target pass (an ancestor-only attention mask: models::AppendBatch
// ::make_tree) and commits the longest path the target's own choices walk. The output is the
// target's, token for token: every committed token is the target's choice after its prefix.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <span>
#include <vector>

namespace dflash::eval {

// Node 0 is the root, the slot's newest committed token (which the target has not run yet);
// every other node is a drafted token whose parent is an earlier node, at depth 1 + its
// parent's (the draft position it was taken from).
struct DraftTree {
  std::vector<int64_t> tokens;
  std::vector<int64_t> parents;  // -1 for the root
  std::vector<int64_t> depths;   // 0 for the root

  int64_t size() const { return static_cast<int64_t>(tokens.size()); }
  // The accepted path: from the root, while the target's choice after the current node
  // (choices[node]) is one of its children, step to that child. Returns the nodes stepped to,
  // in order (empty when the first choice is no child of the root); the choice after the last
  // of them (or the root) is the target's next token.
  std::vector<int64_t> walk(std::span<const int64_t> choices) const;
};

// The tree of the `budget` drafted nodes most likely under the drafter, scoring a path by the
// product of its tokens' probabilities at their positions (the drafter's positions are
// predicted independently, so this is the surrogate DDTree maximizes), chosen best-first with
// a heap: the best frontier node enters, then its first child and its next sibling join the
// frontier. Since a child never scores above its parent, the chosen nodes are the `budget` best
// prefixes and always form a tree. `probs` and `tokens` (CPU, [B-1, K]) hold each position's K
// most likely tokens in decreasing probability; tokens of zero probability never enter, so the
// tree may hold fewer nodes. Of candidates that score the same, the one that joined the
// frontier first enters first.
DraftTree build_draft_tree(int64_t root_token, const at::Tensor& probs, const at::Tensor& tokens,
                           int64_t budget);

}  // namespace dflash::eval
