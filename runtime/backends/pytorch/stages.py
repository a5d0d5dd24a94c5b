"""The round as named stages, for slots 0..b-1: draft -> expand -> build -> verify -> accept (commit),
and plain decoding's step. This is the only code CUDA graphs capture: it reads no host value (the
host's ``bound`` is a Python int fixed per call, 0 when captured or compiled). The drafter and the
verifier run once over all slots; the expansion and acceptance are the one-sequence functions mapped
over the slots (torch.vmap: one batched call each); the tree build takes the batch itself.

The stage timer and the cost probe (pytorch.probe) wrap these methods from outside. A round may
report its verified tree's nodes (path scores, ranks, accepted or not) for the self-tuning tree.
"""

from __future__ import annotations

import dataclasses

import torch

from treeflash_export.config import TreeConfig
from treeflash_export.models.expand import marginal_tables, treeflash_tables
from treeflash_export.tree import Tables, Tree, build_tree, node_paths, on_accepted_path

from ...sampling import accept, choose_tokens_keyed
from .state import OBS_NODES, SlotState

STAGES = ("draft", "expand", "build", "verify", "accept", "accept_plain", "keep_context")


def expansion_depth(tree: TreeConfig, block_size: int) -> int:
    """How many of the drafter's block positions a round expands: a tree of n nodes (the root among
    them) is at most n - 1 deep, so positions past that are never drafted from. The expansion is
    mostly the LM head's weight reads, so the rows saved count less than their share. The chain
    drafts the whole block."""
    if tree.mode == "chain":
        return block_size
    return min(block_size, tree.tree_size)


def build_tree_fast(tables: Tables, root: torch.Tensor, tree_size: int) -> Tree:
    """The tree-build kernel (treeflash_kernels.build_tree, one program per tree) on CUDA where it
    fits, else the tree algebra's build_tree: the same trees either way. Single or batched tables."""
    from treeflash_kernels import build_tree as bt
    from treeflash_kernels.mlp_expand import runs_triton

    D, _, K = tables.tokens.shape[-3:]
    if runs_triton(tables.tokens) and bt.kernel_fits(D, K, tree_size):
        return Tree(*bt.build_tree_triton(tables, root, tree_size))
    return build_tree(tables, root, tree_size)


class RoundStages:
    """The stage functions over one runner's models and slot state."""

    def __init__(self, verifier, drafter, head, slots: SlotState, *, fused: bool, fast_kernels: bool,
                 use_graphs: bool, lazy_context: bool):
        self.verifier, self.drafter, self.head, self.slots = verifier, drafter, head, slots
        self.fused, self.fast_kernels = fused, fast_kernels
        self.use_graphs, self.lazy_context = use_graphs, lazy_context
        self.block_size = slots.block_size
        self.mask_token_id = drafter.cfg.mask_token_id if drafter is not None else -1
        self.build_tree = build_tree_fast if fast_kernels else build_tree

    # ------------------------------------------------------------------ the two rounds

    def run(self, b: int, tree: TreeConfig, kind: int, bound: int = 0, *, report: bool = False,
            keep_context: bool = False, flush: bool = True) -> None:
        """One round: a tree round, or (mode 'ar') a plain step. report: the verified tree's nodes go to
        the state's reports (at most OBS_NODES); keep_context: a plain step's features join the
        drafter's pending context; flush: with graphs, whether that context enters the drafter's cache
        now (the host decides, see TorchRunner)."""
        if tree.mode == "ar":
            self.plain(b, kind, bound, keep_context, flush)
            return
        st = self.slots.state
        self.slots.pending_bound = None  # the round's commit sets each slot's pending count anew
        root = st.root[:b]
        z = self.draft(b, bound)
        tables = self.expand(b, root, z[:, : expansion_depth(tree, self.block_size)], tree)
        trees = self.build(b, tables, root, tree.tree_size, report and tree.tree_size <= OBS_NODES)
        tokens, _, depths, mask, _ = trees
        y, feats = self.verify(b, tokens, depths, mask, kind, bound)
        self.accept(b, trees, y, feats, report and tree.tree_size <= OBS_NODES)

    def plain(self, b: int, kind: int, bound: int, keep_context: bool, flush: bool) -> None:
        """Plain decoding's step: the one node's K/V land at slot P; each active slot gains its token."""
        st = self.slots.state
        root = st.root[:b]
        one = torch.ones(b, 1, 1, dtype=torch.bool, device=root.device)
        y, feats = self.verify(b, root[:, None], torch.zeros_like(root)[:, None], one, kind, bound)
        if keep_context and self.drafter is not None:
            self.keep_context(b, feats, bound, flush)
        self.accept_plain(b, y[:, 0])

    # ------------------------------------------------------------------ stages

    def draft(self, b: int, bound: int = 0) -> torch.Tensor:
        """Stage 1: each slot's pending context enters its drafter cache, then its block
        [root, MASK x (B-1)] at positions P..P+B-1 -> z [b, B, H] (pre-norm)."""
        st, B = self.slots.state, self.block_size
        P, count = st.past_len[:b], st.pending_count[:b]
        block = torch.full((b, B), self.mask_token_id, dtype=torch.long, device=P.device)
        block = torch.cat([st.root[:b, None], block[:, 1:]], dim=1)
        pending = st.pending[:b]
        if self.lazy_context and not self.use_graphs:  # only the rows some slot holds (more than a block)
            pending = pending[:, : max(1, int(count.max()))]
        return self.drafter.model.forward_cached(pending, P - count, count, self.verifier.embed_tokens(block),
                                                 self.slots.first(st.draft_kv, b), key_bound=bound)

    def expand(self, b: int, root: torch.Tensor, z: torch.Tensor, tree: TreeConfig) -> Tables:
        """Stage 2 for slots 0..b-1 (root [b], z [b, B', H]): the one-slot tables mapped over them."""
        return Tables(*_map(b, lambda r, zz: _fields(self.tables(r, zz, tree)), root[:, None], z))

    def tables(self, root: torch.Tensor, z: torch.Tensor, tree: TreeConfig) -> Tables:
        """Stage 2 for one slot: root [1], z [B, H] -> transition tables for the mode (see
        treeflash_export.models.expand)."""
        norm = self.drafter.model.norm
        logits = self.head.logits(norm(z))
        if tree.mode == "treeflash":
            return treeflash_tables(
                z, logits, root, head=self.drafter.ar_approximation, norm=norm,
                embed_tokens=self.verifier.embed_tokens, lm_head=self.head.logits,
                top_m=tree.top_m, top_k=tree.top_k, temperature=tree.drafter_temperature, fused=self.fused,
                topk_kernel=self.fast_kernels, vocab_ids=self.head.ids,
            )
        return marginal_tables(logits, tree.top_k, tree.drafter_temperature, topk_kernel=self.fast_kernels,
                               vocab_ids=self.head.ids)

    def build(self, b: int, tables: Tables, root: torch.Tensor, n: int, report: bool = False) -> tuple:
        """Stage 3: each slot's best-first tree of n nodes (as a tuple of tensors); with report, its
        nodes' path scores and ranks go to the state's reports."""
        trees = _fields(self.build_tree(tables, root, n))
        if report:
            self.report_nodes(b, tables, Tree(*trees))
        return trees

    def verify(self, b: int, tokens, depths, mask, kind: int, bound: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage 4: one verifier pass over every slot's nodes (tokens [b, n] at P + depths, mask
        [b, n, n]) -> (the verifier's token after each node [b, n], features [b, n, F])."""
        st, kv = self.slots.state, self.slots.first(self.slots.state.kv, b)
        P = st.past_len[:b]
        logits, feats = self.verifier.forward_cached(tokens, P[:, None] + depths, mask, kv, P, key_bound=bound)
        y = choose_tokens_keyed(logits, st.temperature[:b], st.top_p[:b], st.seed[:b], P[:, None] + depths + 1, kind)
        return y, feats

    def accept(self, b: int, trees: tuple, y: torch.Tensor, feats: torch.Tensor, report: bool = False) -> None:
        """Stage 5: accept each slot's deepest matching path (tau nodes) and commit it, in fixed shapes:
        its K/V move to slots P..P+tau-1 (no RoPE fix-up: a node at depth d already sits at position
        P + d), its features become the drafter's pending context, its drafts and the bonus go to out.
        An inactive slot keeps its state (its cache past its length may change: nothing reads it
        before it is written again)."""
        st, S = self.slots.state, self.slots.slot_size
        L = min(self.block_size, trees[0].shape[1])
        path, tau, bonus = _map(b, lambda tk, pa, de, ma, va, yy: accept(Tree(tk, pa, de, ma, va), yy, L), *trees, y)
        active = st.active[:b]
        ids = torch.arange(L, device=y.device)
        base = torch.arange(b, device=y.device) * S + st.past_len[:b]  # [b] each slot's P, globally
        dst = (base[:, None] + ids).flatten()
        src = (base[:, None] + path).flatten()
        st.kv.index_copy_(3, dst, st.kv.index_select(3, src))  # gather first (a copy), then write
        tau = torch.where(active, tau, torch.zeros_like(tau))
        st.pending[:b, :L] = torch.where(active[:, None, None], torch.gather(
            feats, 1, path[:, :, None].expand(-1, -1, feats.shape[-1])), st.pending[:b, :L])
        st.pending_count[:b] = torch.where(active, tau, st.pending_count[:b])
        drafts = torch.gather(trees[0], 1, path[:, 1:])
        gained = torch.cat([drafts, bonus[:, None]], dim=1)
        gained = torch.where(ids[None, :] == (tau - 1)[:, None], bonus[:, None], gained)
        st.out[:b, :1] = tau[:, None]
        st.out[:b, 1 : 1 + L] = gained
        st.past_len[:b] += tau
        st.root[:b] = torch.where(active, bonus, st.root[:b])
        if report:  # which of the reported nodes lie on the accepted path
            st.obs_accepted[:b, : trees[0].shape[1]] = on_accepted_path(Tree(*trees), drafts, tau)

    def accept_plain(self, b: int, token: torch.Tensor) -> None:
        """Plain decoding's commit: the one node's K/V already sit at slot P; each active slot gains its token."""
        st = self.slots.state
        active = st.active[:b]
        gained = active.long()
        st.out[:b, 0] = gained
        st.out[:b, 1] = token
        st.past_len[:b] += gained
        st.root[:b] = torch.where(active, token, st.root[:b])

    def keep_context(self, b: int, feats: torch.Tensor, bound: int, flush: bool = True) -> None:
        """Plain decoding inside a speculative generation: the step's own features join the pending
        context, so a tree round may follow. They are appended while the pending buffer has room, and
        the next drafter pass takes them all at once: eagerly on the CPU the buffer holds PREFILL_CHUNK
        rows and the host's bound on the counts decides here; with CUDA graphs it holds the block's B
        rows and the host decided before choosing the graph (``flush``: two captured plain steps, one
        that appends and one that flushes). Once it is full, the pending context enters the drafter's
        cache and the step's features replace it: a plain step runs the drafter once in B steps."""
        slots = self.slots
        st = slots.state
        count, active = st.pending_count[:b], st.active[:b]
        if self.use_graphs and not flush:
            # Every slot's row `count` (clamped: an inactive slot may hold B rows; the host's bound keeps
            # every active one below B); only active slots count it.
            rows = count.clamp_max(st.pending.shape[1] - 1)
            st.pending[slots.slot_rows[:b], rows] = feats[:, 0].to(st.pending.dtype)
            st.pending_count[:b] += active
            return
        if self.lazy_context and not self.use_graphs:
            if slots.pending_bound is None:
                slots.pending_bound = int(st.pending_count.max())
            if slots.pending_bound < st.pending.shape[1]:
                # Row `count` of every slot (an inactive slot's row there is past what it holds, so
                # writing it is harmless); only active slots count it.
                st.pending[slots.slot_rows[:b], count] = feats[:, 0].to(st.pending.dtype)
                st.pending_count[:b] += active
                slots.pending_bound += 1
                return
            slots.pending_bound = 1  # the buffer is full: it enters the drafter's cache now
        self.drafter.model.forward_cached(st.pending[:b], st.past_len[:b] - count, count, None,
                                          slots.first(st.draft_kv, b), key_bound=bound)
        st.pending[:b, :1] = torch.where(active[:, None, None], feats[:, :1].to(st.pending.dtype), st.pending[:b, :1])
        st.pending_count[:b] = torch.where(active, torch.ones_like(count), count)

    def report_nodes(self, b: int, tables: Tables, seen: Tree) -> None:
        """Each node's path score and ranks of ``seen`` (built from ``tables``) into the state's reports."""
        st, n = self.slots.state, seen.tokens.shape[1]
        score, m_rank, k_rank = node_paths(tables, seen)
        st.obs_score[:b, :n] = score
        st.obs_rank[:b, 0, :n] = m_rank
        st.obs_rank[:b, 1, :n] = k_rank


def _map(b: int, fn, *args) -> tuple:
    """fn over the slots (dim 0 of every argument): torch.vmap, or a plain call for one slot (vmap's
    per-operator cost is all overhead there)."""
    if b > 1:
        return torch.vmap(fn)(*args)
    return tuple(out[None] for out in fn(*(a[0] for a in args)))


def _fields(x) -> tuple:
    """A Tables or Tree as the tuple of its tensors (what torch.vmap maps)."""
    return tuple(getattr(x, f.name) for f in dataclasses.fields(x))
