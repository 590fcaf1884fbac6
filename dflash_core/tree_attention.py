"""Scoring a whole draft tree in one pass of ``FastTarget`` (see ``tree.py``), then keeping a path.

Node ``n`` sits at position ``length + depth(n)`` and sees the cached positions and its own
ancestors. Its arithmetic is what autoregressive decoding of its path does: its attention row is
laid out as if its ancestors filled the positions after the cache (scores gathered into that
order; values read in that order: the first path's from the cache itself, every other path's
from its own copy of the value cache, a *replica*, with the path written in, or, when those
copies would pass ``REPLICA_BYTES``, from the cache itself with the path written in, one path at
a time), so the cache span, the masking and the order of every sum are those of
``FastTarget.forward``. In bf16 every node's logits and features equal, bit for bit, those of
decoding its path token by token, so greedy tree verification is exactly the target's greedy
decoding (tested); in fp32 they agree within rounding, as a chain's do.

Where the target's attention is one compiled kernel (``aoti_attention``), whose sums are rounded
its own way, the tree calls that kernel as a chain does: path by path, on the path's new nodes at
their positions, whose keys and values the kernel writes into the cache before its products; so
each path sees its own nodes at its depths.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

import torch
import torch.nn.functional as F

from .kernels import padded_rows
from .tree import DraftTree

if TYPE_CHECKING:
    from .target import FastTarget

# Most memory tree verification may hold in replicas of the value cache; above it, paths take
# turns in the cache itself (more, smaller ops).
REPLICA_BYTES = 256 << 20


class TreeAttention:
    """``forward`` / ``keep_path`` for one ``FastTarget``, and the value replicas kept between
    calls (each replica copies in only the positions committed since it was last used)."""

    def __init__(self, target: FastTarget) -> None:
        self.target = target
        self._pending: tuple | None = None  # (start, nodes, their V) between forward and keep_path
        # (layers, >= paths, kv, capacity, D); positions of replica p below ``_replicas_valid[p]``
        # equal the cache's.
        self._replicas: torch.Tensor | None = None
        self._replicas_valid: list[int] = []

    def reset(self) -> None:
        """The cache was emptied: no replica holds a valid position."""
        self._replicas_valid = [0] * len(self._replicas_valid)

    def truncate(self, length: int) -> None:
        """The cache was cut to ``length`` positions."""
        self._replicas_valid = [min(v, length) for v in self._replicas_valid]

    def forward(self, tree: DraftTree, layer_ids: Sequence[int] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The final rows (before the final norm) and features of every node, in node order
        (``FastTarget.forward_tree`` makes its output of them)."""
        target, cache = self.target, self.target.cache
        groups = tree.leaf_groups()
        if [n for _, nodes in groups for n in nodes] != list(range(len(tree))):
            raise ValueError("forward_tree needs a depth-first tree (dflash_core.tree.depth_first)")
        ids = torch.tensor(tree.tokens, dtype=torch.long, device=target.device)
        real = ids.shape[0]
        start = cache.length
        cache.check_room(start + real)
        depths = torch.tensor(tree.depths, device=target.device)
        ids, depths = padded_rows(target.min_rows, ids, depths)  # as in forward: every row on the multi-row path
        positions = start + depths
        cos, sin = target.cos[positions], target.sin[positions]
        wanted = {i: n for n, i in enumerate(layer_ids or ())}
        feats: list[torch.Tensor | None] = [None] * len(wanted)
        x = F.embedding(ids, target.embed_weight)
        if target._fused_pass is not None:  # every layer in one call, each path's nodes attended as below
            turns = [(nodes[0], nodes[-1] + 1) for _, nodes in groups]
            x, stacked_keys, stacked_values = target._fused_pass.tree(x, cos, sin, positions, turns, wanted, feats, real)
            self._pending = (start, stacked_keys, stacked_values)
        else:
            # One layer's attention for every row, (layer, q, k, v) -> (T, heads * D), laid out for
            # this tree once for all layers.
            attend = (self._compiled_attention if target.attention is not None else self._eager_attention)(
                tree, groups, positions)
            tree_keys, tree_values = [], []
            for li, layer in enumerate(target.layers):
                q, k, v = target.attention_inputs(layer, x, cos, sin)
                tree_keys.append(k[:real].transpose(0, 1))  # (kv, real, d), node order
                tree_values.append(v[:real].transpose(0, 1))
                x = target.finish_layer(layer, x, attend(li, q, k, v))
                if li in wanted:
                    feats[wanted[li]] = x[:real]
            self._pending = (start, torch.stack(tree_keys), torch.stack(tree_values))
        cache.length = start + real
        features = torch.cat(feats, dim=-1) if feats else None
        return x[:real], features

    def _turns(self, tree: DraftTree, runs: Sequence[list[int]], t: int) -> list[tuple[int, int, int, int, int]]:
        """Per run of nodes [a, b) (a path's new nodes, depth-first), ``(depth(a), lo, a, b, hi)``:
        the rows [lo, hi) its product runs on, widened to the multi-row threshold by borrowing
        neighbours. Depth-first, below depth(a) the path before it left exactly this path's
        ancestors in the cache."""
        min_rows = self.target.min_rows
        turns = []
        for nodes in runs:
            a, b = nodes[0], nodes[-1] + 1
            first = max(0, min(a, b - min_rows))
            turns.append((tree.depths[a], first, a, b, max(b, min(t, first + min_rows))))
        return turns

    def _compiled_attention(self, tree: DraftTree, groups: list, positions: torch.Tensor) -> Callable:
        """``aoti_attention``'s kernel path by path, on each path's new nodes (depth-first, the
        path before it left exactly this path's ancestors in the cache at their depths): the
        kernel writes their keys and values at their depths, then attends, as on a chain's rows.
        Its rows are independent of their company (its probe), so no row is borrowed."""
        target, compiled = self.target, self.target.attention
        keys, values, capacity = target.cache.k, target.cache.v, target.cache.capacity
        t, real = positions.shape[0], len(tree)
        turns = []
        for _, nodes in groups:
            a, b = nodes[0], nodes[-1] + 1
            at = positions[a:b].contiguous()
            turns.append((a, b, at, compiled.runs(at.tolist(), capacity)))

        def attend(li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            att = torch.empty(t, q.shape[1] * q.shape[2], dtype=target.dtype, device=target.device)
            for a, b, at, runs in turns:
                att[a:b] = compiled(q[a:b], k[a:b], v[a:b], keys[li], values[li], at, runs)
            if t > real:  # padding rows: copies of the last node
                att[real:] = att[real - 1 : real]
            return att

        return attend

    def _eager_attention(self, tree: DraftTree, groups: list, positions: torch.Tensor) -> Callable:
        """The eager attention (see the module's docstring): scores against the cache with each
        row's ancestors gathered into place, values from the cache, from per-path replicas or from
        the cache with each path written in turn."""
        target, cache = self.target, self.target.cache
        t, real = positions.shape[0], len(tree)
        start, end = cache.length, cache.length + real
        min_rows = target.min_rows
        ancestors = torch.tensor(tree.ancestors(), device=target.device)  # (real, real) node ids
        if t > real:
            ancestors = torch.cat((ancestors, ancestors[-1:].expand(t - real, -1)))
        # The value product. The first path (nodes 0..L-1, depths 0..L-1) finds its values in
        # place in the cache: one product over its rows (at least the multi-row threshold).
        # Every other path p: one batched product of its run of nodes, widened to ``width`` rows
        # by borrowing neighbours (computed, then discarded), against replica p of the value
        # cache, which holds the committed values then p's path in depth order.
        main = max(len(groups[0][1]), min_rows)
        others = groups[1:]
        paths = len(others)
        cap = cache.capacity
        keys, cached_values = cache.k, cache.v
        replica_bytes = target.num_layers * paths * target.num_kv_heads * cap * target.head_dim * cached_values.element_size()
        use_replicas = paths > 0 and replica_bytes <= REPLICA_BYTES
        if paths and not use_replicas:
            turns = self._turns(tree, [nodes for _, nodes in others], t)
        h, kv, d = target.num_heads, target.num_kv_heads, target.head_dim
        if use_replicas:
            # Index vectors for the whole pass (the same in every layer), so that each layer
            # moves rows with index_select / index_copy_, the cheapest indexing ops.
            width = max(max(len(nodes) for _, nodes in others), min_rows)
            firsts = [min(nodes[0], t - width) for _, nodes in others]
            window = [f + i for f in firsts for i in range(width)]  # path p's rows: p*width..
            # Node r of path p is row r - firsts[p] of p's product.
            pick = [p * width + r - firsts[p] for p, (_, nodes) in enumerate(others) for r in nodes]
            # Path p's nodes go into replica p at their depths: flat rows of (paths, kv, cap).
            write_node = [n for path, _ in others for n in path]
            write_row = [(p * kv + head) * cap + start + tree.depths[n]
                         for p, (path, _) in enumerate(others) for n in path for head in range(kv)]
            window, pick, write_node, write_row = (torch.tensor(x, device=target.device)
                                                   for x in (window, pick, write_node, write_row))
            replicas = self._value_replicas(paths, start)
        group = h // kv
        hidden_mask = ~(torch.arange(cap, device=target.device)[None, :] <= positions[:, None])  # (T, cap)
        gather = ancestors[None, :, None, :].expand(kv, t, group, real)

        def attend(li: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            keys[li, :, start:end] = k[:real].transpose(0, 1)
            values = v[:real].transpose(0, 1)  # (kv, real, d), node order
            cached_values[li, :, start:end] = values
            # Rows ordered (kv head, node, query head in the group): a run of nodes is then one
            # (kv, rows, cap) view for the value product.
            qg = q.reshape(t, kv, group, d).transpose(0, 1).reshape(kv, t * group, d)
            scores = torch.matmul(qg, keys[li].transpose(1, 2)).view(kv, t, group, cap)
            # Columns start.. hold the nodes in node order; each row wants its ancestors there.
            scores[..., start:end] = scores[..., start:end].gather(-1, gather)
            scores = scores.masked_fill(hidden_mask[:, None, :], float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(target.dtype)
            first = torch.matmul(probs[:, :main].reshape(kv, main * group, cap), cached_values[li])
            first = first.view(kv, main, group, d).transpose(0, 1)  # (rows, kv, group, d)
            if not paths:  # a chain (with its padding rows, if any)
                att = first
            elif use_replicas:
                layer_replicas = replicas[li, :paths]  # (paths, kv, cap, d), contiguous
                layer_replicas.view(-1, d).index_copy_(0, write_row, v.index_select(0, write_node).view(-1, d))
                chosen = probs.index_select(1, window).view(kv, paths, width * group, cap).transpose(0, 1)
                out = torch.bmm(chosen.reshape(paths * kv, width * group, cap), layer_replicas.view(paths * kv, cap, d))
                out = out.view(paths, kv, width, group, d).transpose(1, 2).reshape(paths * width, kv, group, d)
                parts = [first[: len(groups[0][1])], out.index_select(0, pick)]
                if t > real:  # padding rows: copies of the last node
                    parts.append(parts[-1][-1:].expand(t - real, -1, -1, -1))
                att = torch.cat(parts)
            else:  # one path at a time, its run written into the cache (keep_path restores it)
                att = torch.empty(t, kv, group, d, dtype=target.dtype, device=target.device)
                att[:main] = first
                for depth, lo, a, b, hi in turns:
                    cached_values[li, :, start + depth : start + depth + b - a] = values[:, a:b]
                    part = torch.matmul(probs[:, lo:hi].reshape(kv, (hi - lo) * group, cap), cached_values[li])
                    att[a:b] = part.view(kv, hi - lo, group, d).transpose(0, 1)[a - lo : b - lo]
                if t > real:  # padding rows: copies of the last node
                    att[real:] = att[real - 1 : real]
            return att.reshape(t, h * d)

        return attend

    def _value_replicas(self, paths: int, start: int) -> torch.Tensor:
        """(layers, >= paths, kv, capacity, D) copies of the value cache, the first ``paths``
        valid before ``start`` (path-major, so one layer's first ``paths`` replicas are one
        contiguous block)."""
        cache = self.target.cache
        old = self._replicas
        if old is None or old.shape[1] < paths or old.shape[3] != cache.capacity:
            count = paths if old is None or old.shape[1] < paths else old.shape[1]
            shape = (cache.layers, max(count, 8), cache.kv_heads, cache.capacity, cache.head_dim)
            self._replicas = torch.zeros(shape, dtype=cache.dtype, device=cache.device)
            self._replicas_valid = [0] * shape[1]
        for p in range(paths):
            valid = self._replicas_valid[p]
            if valid < start:
                self._replicas[:, p, :, valid:start] = cache.v[:, :, valid:start]
            self._replicas_valid[p] = start
        return self._replicas

    def keep_path(self, nodes: Sequence[int]) -> None:
        """After ``forward``: keep the K/V of ``nodes`` (a root-first path) at consecutive
        positions, where autoregressive decoding of that path would have put them."""
        cache = self.target.cache
        start, keys, values = self._pending
        index = torch.tensor(list(nodes), device=cache.device)
        cache.k[:, :, start : start + len(nodes)] = keys[:, :, index]
        cache.v[:, :, start : start + len(nodes)] = values[:, :, index]
        cache.length = start + len(nodes)
        self._pending = None
