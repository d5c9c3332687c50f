"""Tree verification of a DFlash draft: the target checks several candidates per block position in
one forward pass instead of one chain.

The drafter gives a distribution per block position in one pass. A chain verifies the top token of
each; a tree also verifies runners-up. `build_tree` keeps the `size` candidate paths of highest draft
probability (product of the per-position probabilities along the path; best-first, as EAGLE-2
grows its trees), so every node's parent is in the tree and rows come in topological order. Row 0 of
the verify block is the root (the newest committed token); row j >= 1 is node j. `tree_mask` lets
each row see the context, its ancestors and itself; with `flashdraft.target.make_verification_exact`
each row then computes bit for bit what a one-token decode step over that path computes, so the
greedy walk (`greedy_path`) commits exactly the tokens plain greedy decoding would.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftTree:
    tokens: torch.Tensor  # [N] the token of node j at index j - 1
    parents: tuple[int, ...]  # row of each node's parent (0: the root)
    depths: tuple[int, ...]  # block position of each node (1..B-1)
    path_probs: tuple[float, ...] = ()  # draft probability of each node's path from the root (best-first: falling)

    @property
    def size(self) -> int:
        return len(self.parents)

    def children(self) -> list[list[int]]:
        """Rows of each row's children, root first."""
        kids = [[] for _ in range(self.size + 1)]
        for j, p in enumerate(self.parents, start=1):
            kids[p].append(j)
        return kids


def build_tree(draft_logits: torch.Tensor, size: int, branching: int = 4) -> DraftTree:
    """The `size` most probable candidate paths of a block's drafts (draft_logits [B-1, V]), each
    position offering its `branching` most probable tokens."""
    if size < 1 or branching < 1:
        raise ValueError(f"tree size and branching must be >= 1, got {size} and {branching}")
    probs, ids = torch.softmax(draft_logits.float(), dim=-1).topk(min(branching, draft_logits.shape[-1]), dim=-1)
    probs, ids = probs.tolist(), ids.tolist()
    depth_max, width = len(probs), len(probs[0])
    tokens, parents, depths, path_probs = [], [], [], []
    # (minus path probability, tie-break, parent row, depth, rank of the token among that depth's)
    frontier = [(-probs[0][0], 0, 0, 1, 0)]
    pushed = 1
    while frontier and len(tokens) < size:
        score, _, parent, depth, rank = heapq.heappop(frontier)
        tokens.append(ids[depth - 1][rank])
        parents.append(parent)
        depths.append(depth)
        path_probs.append(-score)
        row = len(tokens)
        if rank + 1 < width:  # the next sibling: same parent, the next token at this depth
            sibling = score / probs[depth - 1][rank] * probs[depth - 1][rank + 1] if probs[depth - 1][rank] > 0 else 0.0
            heapq.heappush(frontier, (sibling, pushed, parent, depth, rank + 1))
            pushed += 1
        if depth < depth_max:  # the first child: this path extended by the next depth's top token
            heapq.heappush(frontier, (score * probs[depth][0], pushed, row, depth + 1, 0))
            pushed += 1
    return DraftTree(
        torch.tensor(tokens, dtype=torch.long, device=draft_logits.device),
        tuple(parents),
        tuple(depths),
        tuple(path_probs),
    )


def tree_mask(tree: DraftTree, context: int, device=None) -> torch.Tensor:
    """Bool SDPA mask [1, 1, N+1, context+N+1]: every row sees the `context` cached tokens, the root,
    its ancestors and itself."""
    n = tree.size + 1
    mask = torch.zeros(n, context + n, dtype=torch.bool)
    mask[:, : context + 1] = True
    for row in range(1, n):
        mask[row, context + row] = True
        mask[row, context : context + n] |= mask[tree.parents[row - 1], context : context + n]
    return mask.to(device)[None, None]


def greedy_path(tree: DraftTree, target_logits: torch.Tensor) -> tuple[list[int], torch.Tensor]:
    """(rows of the accepted nodes, next token): from the root, follow the child whose token is the
    target's argmax at the current row, as far as one exists; the next token is the target's argmax
    where the walk stops. target_logits [N+1, V], row order as the tree's."""
    choice = target_logits.argmax(dim=-1)
    path = follow(tree, lambda row, depth: choice[row])
    return path, choice[path[-1] if path else 0]


def follow(tree: DraftTree, choose) -> list[int]:
    """Rows of the longest path whose node at each step is `choose(row, depth)` of the row before it."""
    kids, tokens = tree.children(), tree.tokens.tolist()
    path, row = [], 0
    while True:
        want = int(choose(row, len(path)))
        row = next((k for k in kids[row] if tokens[k - 1] == want), None)
        if row is None:
            return path
        path.append(row)
