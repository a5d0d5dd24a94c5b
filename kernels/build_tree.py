"""The tree build (transition tables -> a fixed-shape draft tree) as one Triton kernel.

The reference is the tree algebra's ``build_tree`` (treeflash_export.tree, which the tests
compare this kernel with; this package imports nothing from there): a depth-synchronous beam of width
W = N - 1 over the tables, then the best W nodes over all depths, under the total order
(score desc, then the entry's index in the flattened candidate list asc). In PyTorch it is
about 20 small operations per depth plus the ancestor mask, some 530 operators (nearly all
kernel launches) for a block of 16; here it is one program (one thread block) that keeps the
beam in a scratch buffer and orders each depth's candidates with one sort.

The order is reproduced exactly: each candidate becomes one int64 key, its float32 score
mapped to an order-preserving int32 in the high half and (its index counted from the end)
in the low half, so a descending sort puts higher scores first and, among equal scores,
lower indices first, as the reference's stable pairwise ranking does. -0.0 is folded into
+0.0 before the mapping (the comparisons treat them as equal).
"""

from __future__ import annotations

import torch

from .mlp_expand import _pow2

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference still works; the kernel needs `pip install triton`
    triton = None

# Largest sort the kernel does in one thread block (candidates per depth, W x K, and D x W
# entries overall, each rounded up to a power of two); larger trees use the reference.
MAX_SORT = 4096
MAX_NODES = 128


def kernel_fits(depths: int, top_k: int, tree_size: int) -> bool:
    W = tree_size - 1
    return (W >= 1 and tree_size <= MAX_NODES and _pow2(W * top_k) <= MAX_SORT and _pow2(depths * W) <= MAX_SORT
            and _pow2(max(top_k, W)) <= MAX_SORT)


if triton is not None:

    @triton.jit
    def _sort_key(score, idx, LAST: tl.constexpr):
        """int64 keys whose descending order is (score desc, idx asc)."""
        bits = (score + 0.0).to(tl.int32, bitcast=True)  # + 0.0 folds -0.0 into +0.0
        ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        return (ordered.to(tl.int64) << 32) + (LAST - idx).to(tl.int64)

    @triton.jit
    def _key_index(key, LAST: tl.constexpr):
        return LAST - (key & 0xFFFFFFFF)

    @triton.jit
    def _key_score(key):
        ordered = (key >> 32).to(tl.int32)
        return (ordered ^ ((ordered >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)

    @triton.jit
    def build_tree_kernel(tok_ptr, lp_ptr, nxt_ptr, root_ptr, M, K,
                          b_score, b_tok, b_row, b_slot, node_of, flat_of,
                          out_tok, out_par, out_dep, out_mask, out_valid,
                          D: tl.constexpr, W: tl.constexpr, CAND: tl.constexpr, FLAT: tl.constexpr,
                          NP: tl.constexpr):
        """Tables tok/nxt [D, M, K] int64 and lp [D, M, K] float32 -> the tree's five tensors.
        Scratch: b_* [D * W] (the beam of each depth, best first), node_of [D * W], flat_of [W].
        One program per tree: program_id(0) = b selects tables, root, scratch and outputs of tree b
        (every buffer has a leading batch axis)."""
        b = tl.program_id(0).to(tl.int64)
        table = b * D * M * K
        tok_ptr += table
        lp_ptr += table
        nxt_ptr += table
        root_ptr += b
        beam = b * D * W
        b_score += beam
        b_tok += beam
        b_row += beam
        b_slot += beam
        node_of += beam
        flat_of += b * W
        out_tok += b * (W + 1)
        out_par += b * (W + 1)
        out_dep += b * (W + 1)
        out_valid += b * (W + 1)
        out_mask += b * (W + 1) * (W + 1)
        c = tl.arange(0, CAND)  # a candidate's index
        j = tl.arange(0, CAND)  # a position in the sorted order (the beam keeps j < W)
        # Depth 1: the root's children (row 0 of depth 0), K of them, padded to W with -inf.
        ok = c < K
        s = tl.load(lp_ptr + c, mask=ok, other=float("-inf"))
        key = tl.sort(_sort_key(s, c, CAND - 1), descending=True)
        sel = _key_index(key, CAND - 1)
        real = sel < K
        keep = j < W
        tl.store(b_score + j, _key_score(key), mask=keep)
        tl.store(b_tok + j, tl.load(tok_ptr + sel, mask=keep & real, other=0), mask=keep)
        tl.store(b_row + j, tl.load(nxt_ptr + sel, mask=keep & real, other=0), mask=keep)
        tl.store(b_slot + j, tl.zeros([CAND], tl.int64), mask=keep)
        tl.debug_barrier()
        # Depths 2..D: each beam entry's K children, scored by path sum; keep the best W.
        for d in range(1, D):
            w = c // K
            k = c % K
            ok = c < W * K
            ps = tl.load(b_score + (d - 1) * W + w, mask=ok, other=float("-inf"))
            prow = tl.load(b_row + (d - 1) * W + w, mask=ok, other=-1)
            pok = ok & (ps > float("-inf")) & (prow >= 0)
            r = tl.maximum(prow, 0)
            cell = (d * M + r) * K + k
            s = tl.where(pok, ps + tl.load(lp_ptr + cell, mask=ok, other=0.0), float("-inf"))
            key = tl.sort(_sort_key(s, c, CAND - 1), descending=True)
            sel = _key_index(key, CAND - 1)
            real = keep & (sel < W * K)
            sw = sel // K
            srow = tl.maximum(tl.load(b_row + (d - 1) * W + sw, mask=real, other=0), 0)
            scell = (d * M + srow) * K + sel % K
            tl.store(b_score + d * W + j, _key_score(key), mask=keep)
            tl.store(b_tok + d * W + j, tl.load(tok_ptr + scell, mask=real, other=0), mask=keep)
            tl.store(b_row + d * W + j, tl.load(nxt_ptr + scell, mask=real, other=0), mask=keep)
            tl.store(b_slot + d * W + j, tl.where(real, sw, 0).to(tl.int64), mask=keep)
            tl.debug_barrier()
        # The best W over all depths (flat index = depth-major, beam order within a depth).
        f = tl.arange(0, FLAT)
        fs = tl.load(b_score + f, mask=f < D * W, other=float("-inf"))
        fkey = tl.sort(_sort_key(fs, f, FLAT - 1), descending=True)
        chosen = _key_index(fkey, FLAT - 1)
        good = _key_score(fkey) > float("-inf")
        # Node order: chosen real entries in flat order, then chosen padding entries; the rest last.
        rank = tl.where(f < W, tl.where(good, 0, 1), 2).to(tl.int64)
        order = tl.sort((rank << 32) + chosen, descending=False)
        flat = order & 0xFFFFFFFF
        tl.store(node_of + f, tl.zeros([FLAT], tl.int64), mask=f < D * W)
        tl.debug_barrier()
        tl.store(flat_of + f, flat, mask=f < W)
        tl.store(node_of + flat, f.to(tl.int64) + 1, mask=f < W)
        tl.debug_barrier()
        # Node n + 1 (n < W): its flat entry, depth, token and parent.
        n = tl.arange(0, NP)
        on = n < W
        fl = tl.load(flat_of + n, mask=on, other=0)
        valid = on & (tl.load(b_score + fl, mask=on, other=float("-inf")) > float("-inf"))
        depth = fl // W + 1
        parent_flat = tl.maximum((depth - 2) * W + tl.load(b_slot + fl, mask=on, other=0), 0)
        parent = tl.where(depth > 1, tl.load(node_of + parent_flat, mask=on, other=0), 0)
        parent = tl.where(valid, parent, 0)
        depth = tl.where(valid, depth, 1)
        token = tl.where(valid, tl.load(b_tok + fl, mask=on, other=0), 0)
        tl.store(out_tok + 1 + n, token, mask=on)
        tl.store(out_par + 1 + n, parent, mask=on)
        tl.store(out_dep + 1 + n, depth, mask=on)
        tl.store(out_valid + 1 + n, valid.to(tl.int1), mask=on)
        first = n == 0
        tl.store(out_tok + n, tl.load(root_ptr + n, mask=first, other=0), mask=first)
        tl.store(out_par + n, tl.full([NP], -1, tl.int64), mask=first)
        tl.store(out_dep + n, tl.zeros([NP], tl.int64), mask=first)
        tl.store(out_valid + n, first.to(tl.int1), mask=first)
        tl.debug_barrier()
        # Ancestor-or-self mask by pointer jumping, D steps (the deepest node is at depth D).
        N = W + 1
        a = tl.arange(0, NP)
        row_ok = a < N
        mask = a[:, None] == a[None, :]
        cur = tl.load(out_par + a, mask=row_ok, other=-1)
        for _ in range(D):
            hit = cur >= 0
            mask = mask | ((cur[:, None] == a[None, :]) & hit[:, None])
            cur = tl.where(hit, tl.load(out_par + tl.maximum(cur, 0), mask=row_ok & hit, other=-1), cur)
        tl.store(out_mask + a[:, None] * N + a[None, :], mask.to(tl.int1), mask=row_ok[:, None] & row_ok[None, :])


def build_tree_triton(tables, root: torch.Tensor, tree_size: int) -> tuple[torch.Tensor, ...]:
    """One launch; the same tree as treeflash_export.tree.build_tree, exactly. tables: the
    transition tables (``tokens``, ``logprobs``, ``next_row``, each [D, M, K]); returns the tree's
    (tokens [N], parents [N], depths [N], mask [N, N], valid [N]), the fields of its Tree.
    Batched: tables [b, D, M, K] and root [b] -> every field with a leading [b] (one program per tree)."""
    if triton is None:
        raise RuntimeError("the tree-build kernel needs triton: pip install triton")
    if tables.tokens.dim() == 3:
        batched = type(tables)(*(t[None] for t in (tables.tokens, tables.logprobs, tables.next_row)))
        return tuple(x[0] for x in build_tree_triton(batched, root.reshape(1), tree_size))
    nb, D, M, K = tables.tokens.shape
    if not kernel_fits(D, K, tree_size):
        raise ValueError(f"build_tree kernel: D={D}, K={K}, N={tree_size} exceed its limits "
                         f"(sorts up to {MAX_SORT}, {MAX_NODES} nodes); use the reference")
    W, dev = tree_size - 1, tables.tokens.device
    scratch = dict(b_score=torch.empty(nb, D * W, device=dev, dtype=torch.float32),
                   **{name: torch.empty(nb, D * W, device=dev, dtype=torch.long) for name in ("b_tok", "b_row", "b_slot",
                                                                                            "node_of")},
                   flat_of=torch.empty(nb, W, device=dev, dtype=torch.long))
    out = dict(out_tok=torch.empty(nb, tree_size, device=dev, dtype=torch.long),
               out_par=torch.empty(nb, tree_size, device=dev, dtype=torch.long),
               out_dep=torch.empty(nb, tree_size, device=dev, dtype=torch.long),
               out_mask=torch.empty(nb, tree_size, tree_size, device=dev, dtype=torch.bool),
               out_valid=torch.empty(nb, tree_size, device=dev, dtype=torch.bool))
    build_tree_kernel[(nb,)](
        tables.tokens.contiguous(), tables.logprobs.float().contiguous(), tables.next_row.contiguous(),
        root.reshape(nb).to(torch.long), M, K, *scratch.values(), *out.values(),
        D=D, W=W, CAND=_pow2(max(W * K, K, W)), FLAT=_pow2(D * W), NP=_pow2(tree_size), num_warps=4)
    return out["out_tok"], out["out_par"], out["out_dep"], out["out_mask"], out["out_valid"]
