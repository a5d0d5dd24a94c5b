"""The slot state: the device buffers a round reads and writes, preallocated once (captured graphs
keep their addresses), the host's mirror of what it knows without reading the device, and the slot
life cycle (admit, prefill pass, release).

Slots are kept packed (the occupied ones are 0..occupied-1; ``release`` moves the last one into a
freed slot), so a round over the first b slots serves everyone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from treeflash_export.config import SamplingConfig

from ...plan import PREFILL_CHUNK
from ...sampling import GREEDY, NUCLEUS, choose_tokens_keyed, sampling_kind
from ..base import allocate_caches

OBS_NODES = 64  # the largest tree whose nodes a round reports to the self-tuning tree


@dataclass
class RoundState:
    """What a round reads and writes. Q = max_batch request slots (M stays the tree's parents per
    position); S' = per-slot cache slots (capacity + spare).

    kv        [L, 2, Hkv, Q * S', D]   verifier caches, slot q's at q * S'; slots < past_len are committed
    draft_kv  [Ld, 2, Hkv, Q * S', D]  drafter context caches; slots < past_len - pending_count are filled
    past_len  [Q] int64   committed tokens
    root      [Q] int64   the last emitted token: node 0 of the next tree, at position past_len
    pending   [Q, R, F]   verifier features of the tokens the last round committed, still to enter
                          the drafter's cache (positions past_len - pending_count ..); R = B, or
                          PREFILL_CHUNK eagerly on the CPU (plain steps append to it, see
                          RoundStages.keep_context; with CUDA graphs until the B rows are full)
    pending_count [Q] int64
    out       [Q, B + 1] int64  out[q, 0] = tokens gained by slot q in the last call, then the tokens
    active    [Q] bool    the round advances this slot (False: idle, or still being prefilled)
    temperature, top_p [Q] float32; seed [Q] int64: the slot's request's sampling
    obs_score [Q, OBS] float32, obs_rank [Q, 2, OBS] int64, obs_accepted [Q, OBS] bool: when a round
              reports its nodes, their path scores, largest parent row and child rank on the path
              (treeflash_export.tree.node_paths), and whether accepted (tree order)
    A round accepts at most min(N, B) nodes per slot, the rows of pending and out it uses.
    """

    kv: torch.Tensor
    draft_kv: torch.Tensor | None
    past_len: torch.Tensor
    root: torch.Tensor
    pending: torch.Tensor
    pending_count: torch.Tensor
    out: torch.Tensor
    active: torch.Tensor
    temperature: torch.Tensor
    top_p: torch.Tensor
    seed: torch.Tensor
    obs_score: torch.Tensor
    obs_rank: torch.Tensor
    obs_accepted: torch.Tensor

    def rows(self) -> tuple[torch.Tensor, ...]:
        """The per-slot state rows (everything but the caches and the node reports)."""
        return (self.past_len, self.root, self.pending, self.pending_count, self.out, self.active,
                self.temperature, self.top_p, self.seed)


class SlotState:
    """The request slots' device state and the host's mirror of it: each slot's committed length
    (from the tokens each call returns), its request's sampling kind, and an upper bound of the
    pending drafter context over the slots (None: unknown)."""

    def __init__(self, verifier, drafter, *, max_batch: int, capacity: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, lazy_context: bool, workspace_rows: int, graphs: bool):
        self.max_batch, self.block_size, self.device = max_batch, block_size, device
        self.slot_size = capacity + max(PREFILL_CHUNK, block_size)
        self.host_len = [0] * max_batch
        self.host_kind = [GREEDY] * max_batch
        self.pending_bound: int | None = 0
        self.slot_rows = torch.arange(max_batch, device=device)
        v, Q, S = verifier, max_batch, self.slot_size
        shapes = {"verifier cache": (v.num_layers, 2, v.num_kv_heads, Q * S, v.head_dim)}
        if drafter is not None:
            c = drafter.cfg
            shapes["drafter cache"] = (c.num_layers, 2, c.num_kv_heads, Q * S, c.head_dim)
        feat = len(v.tap_layer_ids) * v.hidden_size
        # The captured rounds share one memory pool, which holds about the largest round's
        # temporaries: logits [Q, N, V] and the layers' activations over Q x N rows.
        rows = Q * max(workspace_rows, block_size, PREFILL_CHUNK)
        elem = torch.empty((), dtype=dtype).element_size()
        work = {"graph workspace": rows * (v.vocab_size + 8 * max(v.hidden_size, feat)) * elem if graphs else 0}
        caches = allocate_caches(shapes, dtype, device, capacity, slots=Q if Q > 1 else 0, extra=work)
        zeros = torch.zeros(Q, dtype=torch.long, device=device)
        pending_rows = max(block_size, PREFILL_CHUNK) if lazy_context else block_size
        self.state = RoundState(
            kv=caches["verifier cache"], draft_kv=caches.get("drafter cache"), past_len=zeros.clone(),
            root=zeros.clone(), pending=torch.zeros(Q, pending_rows, feat, dtype=dtype, device=device),
            pending_count=zeros.clone(), out=torch.zeros(Q, block_size + 1, dtype=torch.long, device=device),
            active=torch.zeros(Q, dtype=torch.bool, device=device),
            temperature=torch.zeros(Q, dtype=torch.float32, device=device),
            top_p=torch.ones(Q, dtype=torch.float32, device=device), seed=zeros.clone(),
            obs_score=torch.zeros(Q, OBS_NODES, dtype=torch.float32, device=device),
            obs_rank=torch.zeros(Q, 2, OBS_NODES, dtype=torch.long, device=device),
            obs_accepted=torch.zeros(Q, OBS_NODES, dtype=torch.bool, device=device),
        )

    def first(self, cache: torch.Tensor | None, b: int) -> torch.Tensor | None:
        """The first b slots' caches [L, 2, Hkv, b * S', D], a view."""
        return None if cache is None else cache.narrow(3, 0, b * self.slot_size)

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
        self.host_len[slot] = 0
        self.host_kind[slot] = sampling_kind(sampling.temperature, sampling.top_p)

    def release(self, slot: int, occupied: int) -> None:
        """Frees ``slot`` of ``occupied`` packed slots. The last occupied slot (if another) moves into
        it: its state rows, and of its caches only the committed part (the host knows its length), so
        the cost follows the request, not the capacity."""
        st, last = self.state, occupied - 1
        if slot != last:
            used = min(self.host_len[last] + self.block_size, self.slot_size)  # + the pending block's drafter K/V
            for cache in (st.kv, st.draft_kv):
                if cache is not None:
                    cache.narrow(3, slot * self.slot_size, used).copy_(cache.narrow(3, last * self.slot_size, used))
            for t in st.rows():
                t[slot] = t[last]
            self.host_len[slot], self.host_kind[slot] = self.host_len[last], self.host_kind[last]
        st.active[last] = False
        st.past_len[last] = 0
        st.pending_count[last] = 0
        self.host_len[last], self.host_kind[last] = 0, GREEDY

    def pass_inputs(self, rows: list[tuple[int, torch.Tensor, bool]], width: int) -> tuple[torch.Tensor, ...]:
        """A prefill pass's arguments: tokens [k, width] (each row padded), slots, counts [k], last [k] bool."""
        tokens = torch.stack([torch.nn.functional.pad(t, (0, width - t.shape[0])) for _, t, _ in rows])
        meta = torch.tensor([[s, int(t.shape[0]), int(last)] for s, t, last in rows], device=self.device)
        return tokens, meta[:, 0], meta[:, 1], meta[:, 2].bool()


def prefill_pass(verifier, drafter, slots: SlotState, tokens: torch.Tensor, slot_ids: torch.Tensor,
                 counts: torch.Tensor, last: torch.Tensor, bound: int = 0) -> None:
    """tokens [k, C] (row i's first counts[i] real) of slots [k] at each slot's positions P..; a row
    whose ``last`` is set ends its prompt: the slot's first new token goes to root, and it turns
    active. Reads no host value (a captured pass)."""
    st, S = slots.state, slots.slot_size
    k, C = tokens.shape
    P = st.past_len[slot_ids]
    ids = torch.arange(C, device=tokens.device)
    causal = (ids[:, None] >= ids[None, :]).expand(k, C, C)
    logits, feats = verifier.forward_cached(tokens, P[:, None] + ids, causal, st.kv, P, key_bound=bound,
                                            logit_rows=(counts - 1).clamp_min(0)[:, None], slot_ids=slot_ids,
                                            slot_size=S)
    if drafter is not None:
        drafter.model.forward_cached(feats, P, counts, None, st.draft_kv, slot_ids=slot_ids, slot_size=S)
    now = P + counts
    st.past_len[slot_ids] = now
    # NUCLEUS handles every request exactly (top_p >= 1 keeps every token); k rows only.
    first = choose_tokens_keyed(logits, st.temperature[slot_ids], st.top_p[slot_ids], st.seed[slot_ids],
                                now[:, None], NUCLEUS)[:, 0]
    st.root[slot_ids] = torch.where(last, first, st.root[slot_ids])
    st.active[slot_ids] = st.active[slot_ids] | last
