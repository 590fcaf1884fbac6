"""Draft trees: one target pass verifies several candidate continuations instead of one.

The DFlash drafter predicts every block slot in one pass, and slot ``i``'s distribution does not
depend on the token drafted for slot ``i - 1`` (the block holds ``MASK`` tokens): each slot's
distribution is a marginal. A chain keeps each slot's top token only, so when slot 1's top token
is wrong the other verified slots are wasted. A tree spends the same verify budget on the most
likely continuations. A node's *score* is the product of the drafter's probabilities along its
path: the chance that the node is kept, were those probabilities calibrated and independent.
Best-first expansion keeps the ``budget`` nodes of highest score, so scores never increase along
the node order and every parent comes before its children.

The target scores every node in one pass (``FastTarget.forward_tree``: a node sees the committed
context and its own ancestors, at the position its depth gives it); ``walk`` then follows the
target's choices from the root, exactly as the chain's prefix rule does. Greedy, the output is
the target's greedy decoding; with the ``match`` rule each kept token is the target's own sample
given the committed prefix, so the output follows the target's distribution.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

BRANCHING = 8  # candidates per slot a node may branch into (the drafter's top-k)


@dataclass
class DraftTree:
    """Node 0 is the root (the anchor token, already committed); the others are drafts."""

    tokens: list[int]
    parents: list[int]  # parent node of each node; -1 for the root
    depths: list[int]  # root 0, its children 1, ...
    scores: list[float]  # estimated chance that each node is kept (the root: 1)

    def __len__(self) -> int:
        return len(self.tokens)

    def path(self, node: int) -> list[int]:
        """Nodes from the root to ``node``, root first."""
        nodes = []
        while node >= 0:
            nodes.append(node)
            node = self.parents[node]
        return nodes[::-1]

    def find_path(self, tokens: Sequence[int]) -> list[int]:
        """The nodes spelling ``tokens`` below the root, as far as the tree holds them."""
        nodes, node = [], 0
        for token in tokens:
            node = next((n for n in range(1, len(self)) if self.parents[n] == node and self.tokens[n] == token), -1)
            if node < 0:
                break
            nodes.append(node)
        return nodes

    def is_chain(self) -> bool:
        return all(parent == index - 1 for index, parent in enumerate(self.parents))

    def ancestors(self) -> list[list[int]]:
        """``table[n][e]``: node ``n``'s ancestor at depth ``e`` for ``e <= depth(n)`` (itself
        last); deeper entries repeat ``n`` (attention masks them out)."""
        size = len(self)
        return [(p := self.path(n)) + [n] * (size - len(p)) for n in range(size)]

    def leaf_groups(self) -> list[tuple[list[int], list[int]]]:
        """Root-to-leaf paths and the nodes first covered by each: ``(path, nodes)``. Every node
        lies on some leaf's path, and a node's attention needs its own path's values in order."""
        has_child = set(self.parents[1:])
        groups, seen = [], set()
        for leaf in range(len(self)):
            if leaf in has_child:
                continue
            path = self.path(leaf)
            nodes = [n for n in path if n not in seen]
            seen.update(nodes)
            groups.append((path, nodes))
        return groups


def chain_tree(anchor: int, tokens: Sequence[int], scores: Sequence[float]) -> DraftTree:
    """A tree that is one chain: ``anchor``, then ``tokens`` in order, each scored by ``scores``."""
    size = len(tokens) + 1
    return DraftTree([anchor] + list(tokens), list(range(-1, size - 1)), list(range(size)), [1.0] + list(scores))


def depth_first(tree: DraftTree) -> DraftTree:
    """The same tree renumbered depth-first, children best first. Then every root-to-leaf path
    adds one contiguous run of nodes (what ``FastTarget.forward_tree`` needs), and the first
    path is nodes ``0..L-1`` in order."""
    children: dict[int, list[int]] = {}
    for node in range(1, len(tree)):
        children.setdefault(tree.parents[node], []).append(node)
    order, stack = [], [0]
    while stack:
        node = stack.pop()
        order.append(node)
        # Node order is best first, so pushing in reverse visits the best child first.
        stack.extend(reversed(children.get(node, [])))
    new_index = {old: new for new, old in enumerate(order)}
    return DraftTree([tree.tokens[n] for n in order], [new_index.get(tree.parents[n], -1) for n in order],
                     [tree.depths[n] for n in order], [tree.scores[n] for n in order])


def build_tree(anchor: int, top_probs: Sequence[Sequence[float]], top_tokens: Sequence[Sequence[int]], budget: int) -> DraftTree:
    """The ``budget`` highest-scoring drafts below ``anchor``.

    ``top_probs[s]`` / ``top_tokens[s]``: the drafter's candidates for block slot ``s + 1``, most
    likely first. A node at depth ``d`` branches into slot ``d + 1``'s candidates.
    """
    tree = DraftTree([anchor], [-1], [0], [1.0])
    slots = len(top_probs)
    # (-score, tie-break order, parent node, depth of the child, rank of the child's candidate)
    heap = [(-float(top_probs[0][r]), r, 0, 1, r) for r in range(len(top_probs[0]))] if slots else []
    heapq.heapify(heap)
    pushed = len(heap)
    while heap and len(tree) <= budget:
        neg, _, parent, depth, rank = heapq.heappop(heap)
        node = len(tree)
        tree.tokens.append(int(top_tokens[depth - 1][rank]))
        tree.parents.append(parent)
        tree.depths.append(depth)
        tree.scores.append(-neg)
        if depth < slots:
            for r in range(len(top_probs[depth])):
                heapq.heappush(heap, (neg * float(top_probs[depth][r]), pushed, node, depth + 1, r))
                pushed += 1
    return tree


def walk(tree: DraftTree, choices: Sequence[int]) -> tuple[list[int], int]:
    """Follow the target from the root: ``choices[n]`` is its token after node ``n``'s path.
    -> (kept nodes, root first; the target's token after the last of them)."""
    children: dict[tuple[int, int], int] = {}
    for node in range(1, len(tree)):
        # The first node with a given token under a parent is the one that counts (the best-
        # scored; duplicates cannot occur: a slot's candidates are distinct tokens).
        children.setdefault((tree.parents[node], tree.tokens[node]), node)
    kept = [0]
    while (child := children.get((kept[-1], int(choices[kept[-1]])))) is not None:
        kept.append(child)
    return kept, int(choices[kept[-1]])


def node_needed(tree: DraftTree, choices: Sequence[int]) -> int | None:
    """The next node whose choice ``walk`` needs, given the nodes' choices known so far (-1: not
    known); None where the walk ends at a known one."""
    kept, choice = walk(tree, choices)  # an unknown choice (-1) is no node's token: the walk stops there
    return kept[-1] if choice < 0 else None


def best_extension(tree: DraftTree, path: list[int]) -> list[int]:
    """``path`` (root first) continued down the tree through each node's best-scored child, to a
    leaf: what a cycle's event shows (the kept nodes, then the likeliest drafts below them).
    ``tree`` must be depth-first, which lists children best first."""
    path = list(path)
    while True:
        child = next((n for n in range(path[-1] + 1, len(tree)) if tree.parents[n] == path[-1]), None)
        if child is None:
            return path
        path.append(child)
