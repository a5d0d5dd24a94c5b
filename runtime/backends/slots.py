"""PyTorch backend for many requests at once: request slots served by one batched round.

The round state gains a slot axis: per slot its verifier and drafter caches (side by side on the
caches' sequence axis, slot m at m * S), its committed length, root, pending drafter context,
output row, sampling settings and an active flag. One round drafts (one drafter pass for all
slots), expands and builds each slot's tree, verifies all trees in one verifier pass (slots x N
nodes, each slot attending to its own cache up to its own length), and accepts and commits per
slot in fixed shapes; the host reads back one [slots, B + 1] buffer.

Slots are kept packed (the occupied ones are 0..occupied-1; ``release`` moves the last one into a
freed slot), so a round over the first b slots serves everyone, and b is a bucket (1, 2, 4, ...,
max_batch): on CUDA each (bucket, tree size, greedy or sampling) round is captured once as a graph
and replayed; prefill chunks run eagerly, between rounds. A slot still being prefilled, or left idle
inside a bucket, is inactive: the round computes it but changes none of its state.

Sampling is keyed (treeflash_runtime.sampling.choose_tokens_keyed): a request's tokens depend on
its prompt, settings and seed only, whatever shares its rounds.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from treeflash_export.config import SamplingConfig, TreeConfig
from treeflash_export.errors import ConfigError
from treeflash_export.tree import Tables, Tree, build_tree, chain_tree

from ..loop import checked_tree
from ..sampling import accept, choose_tokens_keyed
from .base import allocate_caches
from .torch_backend import PREFILL_CHUNK, DeviceState, TorchRunner


@dataclass
class SlotState(DeviceState):
    """DeviceState's fields with a leading slot axis (M slots; S' = per-slot cache slots):

    kv [L, 2, Hkv, M * S', D], draft_kv [Ld, 2, Hkv, M * S', D]: slot m's caches at m * S'..
    past_len, root, pending_count [M]; pending [M, B, F]; out [M, B + 1] (out[m, 0] tokens gained by
    slot m in the last call, then the tokens); and per slot:
    active [M] bool: the round advances this slot (False: idle, or still being prefilled)
    temperature [M] float32, top_p [M] float32, seed [M] int64: the slot's request's sampling
    """

    active: torch.Tensor
    temperature: torch.Tensor
    top_p: torch.Tensor
    seed: torch.Tensor


class SlotRunner(TorchRunner):
    """Up to ``max_batch`` requests served together. The tree settings are the deployment's
    (``tree``, resolved); ``tree_size_by_batch`` may give a smaller tree size for larger buckets."""

    name = "torch"

    def __init__(self, verifier_hf, drafter=None, *, max_batch: int, capacity: int, tree: TreeConfig,
                 tree_size_by_batch: dict[int, int] | None = None, cuda_graphs: bool = True,
                 fast_kernels: bool | None = None, log=None):
        if max_batch < 1:
            raise ConfigError(f"--max-batch must be >= 1, got {max_batch}")
        self.max_batch = int(max_batch)
        super().__init__(verifier_hf, drafter, capacity=capacity, cuda_graphs=cuda_graphs, fast_kernels=fast_kernels,
                         log=log)
        self.tree = checked_tree(self, tree)
        self.buckets = bucket_sizes(self.max_batch)
        self.tree_by_bucket = tree_sizes_by_bucket(self.buckets, self.tree, tree_size_by_batch or {})
        self.max_tree_size = max(self.tree_by_bucket.values())  # the largest tree a round builds
        self.path_len = 1 if self.tree.mode == "ar" else min(self.max_tree_size, self.block_size)

    # ------------------------------------------------------------------ state

    def _allocate(self) -> SlotState:
        v, dev, M = self.verifier, self.device, self.max_batch
        self.slot_size = self.capacity + max(PREFILL_CHUNK, self.block_size)
        shapes = {"verifier cache": (v.num_layers, 2, v.num_kv_heads, M * self.slot_size, v.head_dim)}
        if self.drafter is not None:
            c = self.drafter.cfg
            shapes["drafter cache"] = (c.num_layers, 2, c.num_kv_heads, M * self.slot_size, c.head_dim)
        caches = allocate_caches(shapes, self.dtype, dev, self.capacity, slots=M)
        feat = len(v.tap_layer_ids) * v.hidden_size
        zeros = torch.zeros(M, dtype=torch.long, device=dev)
        return SlotState(
            kv=caches["verifier cache"], draft_kv=caches.get("drafter cache"), past_len=zeros.clone(),
            root=zeros.clone(), pending=torch.zeros(M, self.block_size, feat, dtype=self.dtype, device=dev),
            pending_count=zeros.clone(), out=torch.zeros(M, self.block_size + 1, dtype=torch.long, device=dev),
            active=torch.zeros(M, dtype=torch.bool, device=dev),
            temperature=torch.zeros(M, dtype=torch.float32, device=dev),
            top_p=torch.ones(M, dtype=torch.float32, device=dev), seed=zeros.clone(),
        )

    def _slot_range(self, cache: torch.Tensor | None, slot: int) -> torch.Tensor | None:
        """One slot's caches [L, 2, Hkv, S', D], a view."""
        return None if cache is None else cache.narrow(3, slot * self.slot_size, self.slot_size)

    def _first(self, cache: torch.Tensor | None, b: int) -> torch.Tensor | None:
        """The first b slots' caches [L, 2, Hkv, b * S', D], a view."""
        return None if cache is None else cache.narrow(3, 0, b * self.slot_size)

    # ------------------------------------------------------------------ admission, release

    @torch.inference_mode()
    def admit(self, slot: int, sampling: SamplingConfig) -> None:
        """Slot ``slot`` takes a new request: its length and context start at 0, its sampling is set,
        and it stays inactive until its prefill is done."""
        st = self.state
        st.past_len[slot] = 0
        st.pending_count[slot] = 0
        st.out[slot] = 0
        st.active[slot] = False
        st.temperature[slot] = float(sampling.temperature)
        st.top_p[slot] = float(sampling.top_p)
        st.seed[slot] = int(sampling.seed)

    @torch.inference_mode()
    def prefill(self, slot: int, tokens: torch.Tensor, last: bool) -> int | None:
        """The next chunk of slot ``slot``'s prompt (tokens [c] on the device) into its caches. On the
        last chunk the slot turns active and its first new token is returned (else None)."""
        return self.prefill_many([(slot, tokens, last)])[0]

    @torch.inference_mode()
    def prefill_many(self, chunks: list[tuple[int, torch.Tensor, bool]]) -> list[int | None]:
        """Several slots' next prompt chunks (slot, tokens [c_i], last) in one pass: padded to the
        longest, each row at its own slot's range and length (padding rows write past the chunk, where
        nothing reads them). Returns each slot's first new token on its last chunk, else None."""
        st, dev = self.state, self.device
        k, C = len(chunks), max(int(t.shape[0]) for _, t, _ in chunks)
        slots = torch.tensor([c[0] for c in chunks], device=dev)
        counts = torch.tensor([int(t.shape[0]) for _, t, _ in chunks], device=dev)
        tokens = torch.stack([torch.nn.functional.pad(t, (0, C - t.shape[0])) for _, t, _ in chunks])
        P = st.past_len[slots]
        ids = torch.arange(C, device=dev)
        causal = (ids[:, None] >= ids[None, :]).expand(k, C, C)
        logits, feats = self.verifier.forward_cached(tokens, P[:, None] + ids, causal, st.kv, P,
                                                     logit_rows=(counts - 1)[:, None], slot_ids=slots,
                                                     slot_size=self.slot_size)
        if self.drafter is not None:
            self.drafter.model.forward_cached(feats, P, counts, None, st.draft_kv, slot_ids=slots,
                                              slot_size=self.slot_size)
        st.past_len[slots] = P + counts
        last = [i for i, c in enumerate(chunks) if c[2]]
        out: list[int | None] = [None] * k
        if last:
            rows = torch.tensor(last, device=dev)
            s = slots[rows]
            first = choose_tokens_keyed(logits[rows], st.temperature[s], st.top_p[s], st.seed[s],
                                        st.past_len[s][:, None], bool((st.temperature[s] > 0).any()))[:, 0]
            st.root[s] = first
            st.active[s] = True
            for i, token in zip(last, first.tolist()):
                out[i] = token
        return out

    @torch.inference_mode()
    def release(self, slot: int, occupied: int) -> None:
        """Frees ``slot`` of ``occupied`` packed slots. The last occupied slot (if another) moves into
        it, caches and all (as the scheduler moves its request)."""
        st, last = self.state, occupied - 1
        if slot != last:
            for cache in (st.kv, st.draft_kv):
                if cache is not None:
                    self._slot_range(cache, slot).copy_(self._slot_range(cache, last))
            for t in (st.past_len, st.root, st.pending, st.pending_count, st.out, st.active, st.temperature, st.top_p,
                      st.seed):
                t[slot] = t[last]
        st.active[last] = False
        st.past_len[last] = 0
        st.pending_count[last] = 0

    # ------------------------------------------------------------------ the batched round

    def bucket_for(self, occupied: int) -> int:
        return next(b for b in self.buckets if b >= occupied)

    @torch.inference_mode()
    def step(self, occupied: int, sampling: bool, bound: int = 0) -> list[list[int]]:
        """One round over the first ``occupied`` slots (run as its bucket); returns each slot's gained
        tokens (empty for inactive slots). sampling: whether any slot samples. bound: eagerly, a bound
        the host knows on every running slot's length plus the tree, so the reference attention
        stops there (0: the whole cache; a captured round always reads it all)."""
        b = self.bucket_for(occupied)
        if self.use_graphs:
            key = ("slots", b, self.tree_by_bucket[b], sampling)
            if key not in self._graphs:
                self._capture_round(key)
            self._graphs[key]()
        else:
            self._round_slots(b, self.tree_by_bucket[b], sampling, min(bound, self.slot_size))
        out = self.state.out[:occupied].tolist()  # the one read-back of the round
        return [row[1 : 1 + row[0]] for row in out]

    def _capture_round(self, key: tuple) -> None:
        """Captures the round for (bucket, tree size, sampling) on first use. Warm-up and capture run
        real rounds with every slot inactive (their flags put back after), so no request's state moves:
        an inactive round only writes cache slots past each slot's length and the output rows."""
        _, b, tree_size, sampling = key
        st = self.state
        active = st.active.clone()
        t0 = time.perf_counter()
        try:
            st.active.zero_()
            self._graphs[key] = self._capture(lambda: self._round_slots(b, tree_size, sampling), (),
                                              lambda: st.active.zero_())
        finally:
            st.active.copy_(active)
        self.log(f"captured a CUDA graph ({self.tree.mode} N={tree_size}, {b} slots"
                 f"{', sampling' if sampling else ''}) in {time.perf_counter() - t0:.1f}s")

    def _round_slots(self, b: int, tree_size: int, sampling: bool, bound: int = 0) -> None:
        """draft -> expand -> build trees -> verify -> accept -> commit, for slots 0..b-1. The drafter
        and the verifier run once over all slots; the expansion, the tree build and acceptance are
        the one-sequence functions mapped over the slots (torch.vmap: one batched call each) and the tree
        build the tree algebra's, which takes a batch (the one-sequence runner's kernel takes none)."""
        st, B = self.state, self.block_size
        kv, dkv = self._first(st.kv, b), self._first(st.draft_kv, b)
        P, root = st.past_len[:b], st.root[:b]
        if self.tree.mode == "ar":
            trees = _map(b, lambda r: _fields(chain_tree(r)), root[:, None])
        else:
            with self._stage("draft"):
                block = torch.full((b, B), self.mask_token_id, dtype=torch.long, device=self.device)
                block = torch.cat([root[:, None], block[:, 1:]], dim=1)
                count = st.pending_count[:b]
                z = self.drafter.model.forward_cached(st.pending[:b, : self.path_len], P - count, count,
                                                      self.verifier.embed_tokens(block), dkv, key_bound=bound)
            cfg = dataclasses.replace(self.tree, tree_size=tree_size)
            with self._stage("expand"):
                tables = _map(b, lambda r, zz: _fields(self.tables(r, zz, cfg)), root[:, None], z)
            with self._stage("tree"):
                trees = _fields(build_tree(Tables(*tables), root, tree_size))  # batched natively
        tokens, _, depths, mask, _ = trees
        with self._stage("verify"):
            logits, feats = self.verifier.forward_cached(tokens, P[:, None] + depths, mask, kv, P, key_bound=bound)
            y = choose_tokens_keyed(logits, st.temperature[:b], st.top_p[:b], st.seed[:b], P[:, None] + depths + 1,
                                    sampling)
        with self._stage("accept"):
            self._commit_slots(b, trees, y, feats)

    def _commit_slots(self, b: int, trees: tuple, y: torch.Tensor, feats: torch.Tensor) -> None:
        """TorchRunner.commit for slots 0..b-1 at once, in fixed shapes; an inactive slot keeps its
        state (its cache past its length may change: nothing reads it before it is written again)."""
        st = self.state
        L = min(self.path_len, trees[0].shape[1])
        path, tau, bonus = _map(b, lambda tk, pa, de, ma, va, yy: accept(Tree(tk, pa, de, ma, va), yy, L), *trees, y)
        active = st.active[:b]
        ids = torch.arange(L, device=self.device)
        base = torch.arange(b, device=self.device) * self.slot_size + st.past_len[:b]  # [b] each slot's P, globally
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


def _map(b: int, fn, *args) -> tuple:
    """fn over the slots (dim 0 of every argument): torch.vmap, or a plain call for one slot (vmap's
    per-operator cost is all overhead there)."""
    if b > 1:
        return torch.vmap(fn)(*args)
    return tuple(out[None] for out in fn(*(a[0] for a in args)))


def _fields(x) -> tuple:
    """A Tables or Tree as the tuple of its tensors (what torch.vmap maps)."""
    return tuple(getattr(x, f.name) for f in dataclasses.fields(x))


def bucket_sizes(max_batch: int) -> list[int]:
    """The slot counts rounds are captured for: 1, 2, 4, ... and max_batch itself."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch]


def tree_sizes_by_bucket(buckets: list[int], tree: TreeConfig, table: dict[int, int]) -> dict[int, int]:
    """Each bucket's tree size: the entry of ``table`` (batch size -> N) with the largest batch size
    at most the bucket's, else the deployment's tree size; never more than it."""
    out = {}
    for b in buckets:
        fits = [n for size, n in table.items() if size <= b]
        n = fits[-1] if fits else tree.tree_size
        if tree.mode in ("chain", "ar"):
            n = tree.tree_size  # a chain's length is the block's; plain decoding has one node
        out[b] = min(n, tree.tree_size)
    return out


def parse_tree_size_by_batch(text: str) -> dict[int, int]:
    """'1:64,4:32,16:16' -> {1: 64, 4: 32, 16: 16} (batch sizes ascending)."""
    table = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        size, sep, n = item.partition(":")
        try:
            if not sep:
                raise ValueError
            table[int(size)] = int(n)
        except ValueError:
            raise ConfigError(f"--tree-size-by-batch: {item!r} is not BATCH:TREE_SIZE (e.g. 1:64,4:32,16:16)") from None
        if int(size) < 1 or int(n) < 2:
            raise ConfigError(f"--tree-size-by-batch: {item!r} needs a batch size >= 1 and a tree size >= 2")
    return dict(sorted(table.items()))
