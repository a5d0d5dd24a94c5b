"""PyTorch backend: one round code for one sequence and for many requests (request slots).

The round state has a slot axis: per slot its verifier and drafter caches (side by side on the
caches' sequence axis, slot m at m * S'), its committed length, root, pending drafter context,
output row, sampling settings and an active flag. One round drafts (one drafter pass for all
slots), expands and builds each slot's tree, verifies all trees in one verifier pass (slots x N
nodes, each slot attending to its own cache up to its own length), and accepts and commits per
slot in fixed shapes; the host reads back one [slots, B + 1] buffer. Plain decoding is the same
round with a one-node tree. A single sequence (``treeflash-run``, the Runner contract's
``begin``/``round``) is the one-slot case: the same prefill, the same round, the same captures.

Slots are kept packed (the occupied ones are 0..occupied-1; ``release`` moves the last one into a
freed slot), so a round over the first b slots serves everyone, and b is a bucket (1, 2, 4, ...,
max_batch). On CUDA each (bucket, tree setting, sampling kind) round and each prefill group size
is captured once as a graph and replayed; with a fixed deployment tree (serving) all of them are
captured at start-up. A slot still being prefilled, or left idle inside a bucket, is inactive: the
round computes it but changes none of its state.

Sampling is keyed (treeflash_runtime.sampling.choose_tokens_keyed): a request's tokens depend on
its prompt, settings and seed only, whatever shares its rounds and whatever its tree. Graph keys
hold the sampling kind (greedy, sampling, sampling with top-p), never the values: temperature,
top-p and seed are per-slot device tensors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass

import torch

from treeflash_export.config import SamplingConfig, TreeConfig
from treeflash_export.errors import ConfigError
from treeflash_export.models import TreeVerifier
from treeflash_export.models.expand import marginal_tables, treeflash_tables
from treeflash_export.tree import Tables, Tree, build_tree, node_paths, on_accepted_path

from ..loop import checked_tree
from ..sampling import (
    GREEDY,
    NUCLEUS,
    SAMPLE,
    accept,
    choose_tokens_keyed,
    sampling_kind,
)
from .base import Runner, allocate_caches
from .slots import bucket_sizes, power_of_two_groups, tree_sizes_by_bucket

# Prompt tokens per prefill pass when prefill is captured (CUDA graphs); eager prefill takes a whole
# chunk at once. Each slot's cache carries this many spare slots so padded passes never overflow.
PREFILL_CHUNK = 256
KINDS = (GREEDY, SAMPLE, NUCLEUS)
OBS_NODES = 64  # the largest tree whose nodes a round reports to the self-tuning tree


def expansion_depth(tree: TreeConfig, reported: int, block_size: int) -> int:
    """How many of the drafter's block positions a round expands: a tree of n nodes (the root among
    them) is at most n - 1 deep, so positions past that are never drafted from; with a report of a
    larger tree (reported nodes, 0: none) as deep as that one. The expansion is the drafter's
    positions (and M parent rows each) through the LM head: for the demo pair (a block of 8) at N = 4,
    M = 2, K = 4 it took 12.0 ms instead of 15.9 on one CPU thread (it is mostly the head's weight
    reads, so the rows saved count less than their share). The chain drafts the whole block."""
    if tree.mode == "chain":
        return block_size
    return min(block_size, max(tree.tree_size, reported))


def observed_size(tree: TreeConfig) -> int:
    """The tree whose nodes a round reports to the self-tuning tree: twice the one it verifies (at
    most OBS_NODES), built from the same tables. Best-first trees are prefix-closed, so the verified
    tree is its best half, and its scores tell the acceptance model what a larger tree would hold:
    the next size up is predicted from every round, not only from rounds that ran it (which cost more
    than the choice, so exploration would have to pay for them). The chain has one size."""
    n = tree.tree_size
    return n if tree.mode == "chain" else max(n, min(2 * n, OBS_NODES))


@dataclass
class RoundState:
    """What a round reads and writes, preallocated once per runner (graphs keep their addresses).
    M slots; S' = per-slot cache slots (capacity + spare).

    kv        [L, 2, Hkv, M * S', D]   verifier caches, slot m's at m * S'; slots < past_len are committed
    draft_kv  [Ld, 2, Hkv, M * S', D]  drafter context caches; slots < past_len - pending_count are filled
    past_len  [M] int64   committed tokens
    root      [M] int64   the last emitted token: node 0 of the next tree, at position past_len
    pending   [M, R, F]   verifier features of the tokens the last round committed, still to enter
                          the drafter's cache (positions past_len - pending_count ..); R = B, or
                          PREFILL_CHUNK eagerly on the CPU (plain steps append to it, see _keep_context;
                          with CUDA graphs they append until the B rows are full)
    pending_count [M] int64
    out       [M, B + 1] int64  out[m, 0] = tokens gained by slot m in the last call, then the tokens
    active    [M] bool    the round advances this slot (False: idle, or still being prefilled)
    temperature, top_p [M] float32; seed [M] int64: the slot's request's sampling
    obs_score [M, OBS] float32, obs_rank [M, 2, OBS] int64, obs_accepted [M, OBS] bool: with
              ``observing`` on, the last round's nodes (tree order): path scores, largest parent row
              and child rank on the path (treeflash_export.tree.node_paths), and whether accepted
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


def fast_kernels_default(device: torch.device, compiled: bool) -> bool:
    """The fast kernels are on by default where they run as Triton kernels (CUDA, triton installed),
    unless the steps are compiled: then Inductor does the fusing, over the modules."""
    if device.type != "cuda" or compiled:
        return False
    from treeflash_kernels import layer_ops

    return layer_ops.triton is not None


def draft_head_default(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype the expansion's LM head rows are kept and multiplied in: bf16 on a CPU with bf16
    instructions (AVX512-BF16 or AMX) where the model runs in fp32, else the model's own. The
    expansion multiplies a few rows (the drafter's block, M parent rows per position) by the whole
    draft vocabulary's rows, so it reads the head's weights for little arithmetic; in bf16 it reads
    half as much through faster kernels. On the demo pair's 2-core CPU (23,242 draft rows of 576) it
    took 2.7 ms of a 5.8 ms expansion against 12.7 of 16, and fixed trees generated 14% faster. The
    drafter's numbers decide only which tokens the tree holds; the verifier, in the model's dtype,
    decides the output, so the output is unchanged."""
    if device.type != "cpu" or dtype != torch.float32:
        return dtype
    cpu = torch.cpu
    fast = any(bool(getattr(cpu, name, lambda: False)()) for name in ("_is_avx512_bf16_supported",
                                                                      "_is_amx_tile_supported"))
    return torch.bfloat16 if fast else dtype


def build_tree_fast(tables: Tables, root: torch.Tensor, tree_size: int) -> Tree:
    """The tree-build kernel (treeflash_kernels.build_tree, one program per tree) on CUDA where it
    fits, else the tree algebra's build_tree: the same trees either way. Single or batched tables."""
    from treeflash_kernels import build_tree as bt
    from treeflash_kernels.mlp_expand import runs_triton

    D, _, K = tables.tokens.shape[-3:]
    if runs_triton(tables.tokens) and bt.kernel_fits(D, K, tree_size):
        return Tree(*bt.build_tree_triton(tables, root, tree_size))
    return build_tree(tables, root, tree_size)


def _project_cache(variable: str, name: str) -> None:
    """Compiled code goes under the project's cache folder (TREEFLASH_CACHE), unless the user's
    environment names another place: a second start reuses it, and one folder holds all of it."""
    import os

    from treeflash_export.smollm import cache_root

    os.environ.setdefault(variable, str(cache_root() / name))


class TorchRunner(Runner):
    """The model pair on PyTorch with ``max_batch`` request slots (1: one sequence). ``tree``: the
    deployment's tree setting (serving; resolved here), or None to take each generation's from
    ``begin`` (one sequence); ``tree_size_by_batch`` may give a smaller tree size for larger buckets."""

    name = "torch"

    def __init__(self, verifier_hf, drafter=None, *, capacity: int, max_batch: int = 1, tree: TreeConfig | None = None,
                 tree_size_by_batch: dict[int, int] | None = None, fused: bool = True, cuda_graphs: bool = True,
                 compile: bool = False, fast_kernels: bool | None = None, capture_at_start: bool = True,
                 draft_vocab: int | None = None, draft_head: torch.dtype | None = None, log=None):
        """verifier_hf: a Hugging Face causal LM; drafter: a TreeFlashDrafter or None (plain decoding only).
        fused: the TreeFlash head through torch.ops.treeflash.mlp_expand (the Triton kernels on CUDA,
        the PyTorch reference elsewhere) rather than the module composition.
        cuda_graphs: on CUDA, capture prefill passes and rounds once each (per bucket, tree setting
        and sampling kind) and replay them; ignored elsewhere. compile: torch.compile the prefill pass
        and the round (Inductor fuses the elementwise work between the GEMMs), with its cache under
        the project's cache folder. fast_kernels: kernels that save launches, each with a PyTorch
        reference: the decoder layers through merged projections and the layer kernels (models.fused,
        treeflash_kernels.layer_ops) rather than the Hugging Face modules, the expansion's top-k
        log-probabilities in one read of the logits (treeflash_kernels.topk_logprobs) and the trees
        built in one kernel (treeflash_kernels.build_tree, exactly the reference's trees); None =
        where they run as Triton kernels (CUDA; on CPU the references only add dispatch cost) and the
        steps are not compiled. capture_at_start: with a deployment tree and graphs on, capture every
        graph serving can need now (capture_all) rather than on first use. draft_vocab: how many tokens
        the drafter ranks (treeflash_export.models.draft_vocab): None = the drafter's own list
        (draft-vocab.json; the whole vocabulary without one), 0 = the whole vocabulary, N = its first N.
        draft_head: the dtype of the expansion's LM head rows (a copy; see draft_head_default, None).
        log: progress lines."""
        if max_batch < 1:
            raise ConfigError(f"--max-batch must be >= 1, got {max_batch}")
        self.max_batch = int(max_batch)
        self.drafter = drafter
        self.fused = fused
        tap_ids = drafter.cfg.target_layer_ids if drafter is not None else ()
        self.verifier = TreeVerifier(verifier_hf, tap_ids)
        w = self.verifier.lm_head.weight
        self.device, self.dtype = w.device, w.dtype
        if fast_kernels is None:
            fast_kernels = fast_kernels_default(self.device, compile)
        self.fast_kernels = bool(fast_kernels)
        self.verifier.use_layer_kernels(self.fast_kernels)
        if self.fast_kernels:
            _project_cache("TRITON_CACHE_DIR", "triton")  # the kernels compile on first use
            self.build_tree = build_tree_fast
        else:
            self.build_tree = build_tree
        self._own_drafter_setting()
        self.vocab_size = self.verifier.vocab_size
        self.draft_head = draft_head_default(self.device, self.dtype) if draft_head is None else draft_head
        self._draft_vocabulary(draft_vocab)
        self.block_size = drafter.cfg.block_size if drafter is not None else 1
        self.mask_token_id = drafter.cfg.mask_token_id if drafter is not None else -1
        self.has_head = drafter is not None and drafter.ar_approximation is not None
        self.capacity = int(capacity)
        if self.capacity < 2:
            raise ConfigError(f"--max-seq-len {capacity} is too small")
        self.use_graphs = bool(cuda_graphs) and self.device.type == "cuda"
        self.log = log or (lambda msg: None)
        self.timer: dict[str, float] | None = None  # stage name -> seconds, when a benchmark asks
        self._marks: list | None = None  # (stage, start, end) CUDA events recorded into a timing capture
        self.buckets = bucket_sizes(self.max_batch)
        self.slot_size = self.capacity + max(PREFILL_CHUNK, self.block_size)
        # Eagerly (no graph, no compile: shapes may follow host values) the pending drafter context holds
        # up to PREFILL_CHUNK rows, so plain steps inside a tuned generation append their features and a
        # drafter pass takes many at once (see _keep_context); else the block's B rows.
        self.lazy_context = self.device.type == "cpu" and not compile
        # A host-side upper bound of pending_count over the slots (None: unknown; eagerly it is then read,
        # with graphs the next plain step with context flushes, see _flushes).
        self._pending_bound: int | None = 0
        self._slot_rows = torch.arange(self.max_batch, device=self.device)
        self.state = self._allocate(tree, tree_size_by_batch)
        # The host's mirror of what it knows without reading the device: each slot's committed length
        # (from the tokens each call returns) and its request's sampling kind.
        self.host_len = [0] * self.max_batch
        self.host_kind = [GREEDY] * self.max_batch
        self._graphs: dict[tuple, _Captured] = {}
        self._pool = None
        # Set by the self-tuning tree: rounds report their nodes (obs_*), and plain decoding rounds keep
        # the drafter's context current so that a tree round may follow any of them.
        self.observing = False
        self.keep_context = False
        # Set by the self-tuning tree for a plain step: the tree to draft and score (not verify) after it.
        self.probe_tree: TreeConfig | None = None
        # Set by the self-tuning tree with graphs on: False runs a round whose graph is not captured yet
        # eagerly instead (an exploration round: a setting tried once or a few times is not worth a
        # capture). ran_eagerly: whether the last round did (its time is not a replay's).
        self.capture_now = True
        self.ran_eagerly = False
        self.captured = False  # whether the last round captured a graph (its time is not a replay's)
        self.compiled = bool(compile)
        if self.compiled:
            self._compile_steps()
        self.tree: TreeConfig | None = None
        # The largest tree the caches and captures were sized for, where a deployment's tree was given
        # (request slots); None for a one-sequence runner, whose tree follows each generation.
        self.deployment_tree_size: int | None = None
        if tree is not None:
            self.configure(tree, tree_size_by_batch)
            self.deployment_tree_size = self.max_tree_size
            if self.use_graphs and capture_at_start:
                self.capture_all()

    # ------------------------------------------------------------------ state

    def _allocate(self, tree: TreeConfig | None, table: dict[int, int] | None) -> RoundState:
        v, dev, M, S = self.verifier, self.device, self.max_batch, self.slot_size
        shapes = {"verifier cache": (v.num_layers, 2, v.num_kv_heads, M * S, v.head_dim)}
        if self.drafter is not None:
            c = self.drafter.cfg
            shapes["drafter cache"] = (c.num_layers, 2, c.num_kv_heads, M * S, c.head_dim)
        feat = len(v.tap_layer_ids) * v.hidden_size
        # The captured rounds share one memory pool, which holds about the largest round's
        # temporaries: logits [M, N, V] and the layers' activations over M x N rows.
        rows = M * max(tree.tree_size if tree is not None else 64, self.block_size, PREFILL_CHUNK)
        elem = torch.empty((), dtype=self.dtype).element_size()
        work = {"graph workspace": rows * (v.vocab_size + 8 * max(v.hidden_size, feat)) * elem if self.use_graphs else 0}
        caches = allocate_caches(shapes, self.dtype, dev, self.capacity, slots=M if M > 1 else 0, extra=work)
        zeros = torch.zeros(M, dtype=torch.long, device=dev)
        return RoundState(
            kv=caches["verifier cache"], draft_kv=caches.get("drafter cache"), past_len=zeros.clone(),
            root=zeros.clone(), pending=torch.zeros(M, max(self.block_size, PREFILL_CHUNK) if self.lazy_context
                                                    else self.block_size, feat, dtype=self.dtype, device=dev),
            pending_count=zeros.clone(), out=torch.zeros(M, self.block_size + 1, dtype=torch.long, device=dev),
            active=torch.zeros(M, dtype=torch.bool, device=dev),
            temperature=torch.zeros(M, dtype=torch.float32, device=dev),
            top_p=torch.ones(M, dtype=torch.float32, device=dev), seed=zeros.clone(),
            obs_score=torch.zeros(M, OBS_NODES, dtype=torch.float32, device=dev),
            obs_rank=torch.zeros(M, 2, OBS_NODES, dtype=torch.long, device=dev),
            obs_accepted=torch.zeros(M, OBS_NODES, dtype=torch.bool, device=dev),
        )

    def _first(self, cache: torch.Tensor | None, b: int) -> torch.Tensor | None:
        """The first b slots' caches [L, 2, Hkv, b * S', D], a view."""
        return None if cache is None else cache.narrow(3, 0, b * self.slot_size)

    def configure(self, tree: TreeConfig, tree_size_by_batch: dict[int, int] | None = None) -> None:
        """The tree setting the rounds use (checked and resolved against this pair), and each bucket's
        tree size."""
        self.tree = checked_tree(self, tree)
        self.tree_by_bucket = tree_sizes_by_bucket(self.buckets, self.tree, tree_size_by_batch or {})
        self.bucket_trees: dict[int, TreeConfig | None] = {}
        self._bucket_asked: dict[int, TreeConfig | None] = {}  # the tree each bucket was last given
        self.max_tree_size = max(self.tree_by_bucket.values())  # the largest tree a round builds

    def set_bucket_tree(self, b: int, tree: TreeConfig | None) -> None:
        """The tree the rounds of bucket b use from now on (the self-tuning tree's choice for that
        bucket; None: the deployment's again). It may not be larger than the deployment's tree, which
        sized the caches and the capacity check."""
        if tree is not None and tree is self._bucket_asked.get(b):
            return  # the same object as last time: already checked and set
        asked = tree
        if tree is not None:
            tree = checked_tree(self, tree)
            if tree.tree_size > self.max_tree_size:
                raise ConfigError(f"a tree of {tree.tree_size} nodes is larger than this deployment's "
                                  f"{self.max_tree_size}")
        self.bucket_trees[b] = tree
        self._bucket_asked[b] = asked

    def set_tree(self, tree: TreeConfig) -> None:
        """The next rounds' tree setting (one sequence; the self-tuning tree changes it between rounds)."""
        if tree != self.tree:
            self.configure(tree)

    def _draft_vocabulary(self, size: int | None) -> None:
        """The LM head rows the expansion ranks: ``draft_ids`` (ascending token ids, None for the whole
        vocabulary) and ``draft_rows``, their rows as a copy in ``draft_head``'s dtype (None: the
        verifier's head itself, the whole vocabulary in the model's dtype). ``draft_vocab_size`` is
        their number either way."""
        from treeflash_export.models import draft_vocab

        order = self.drafter.vocab_order if self.drafter is not None else None
        ids = draft_vocab.select(order, size, self.vocab_size) if self.drafter is not None else None
        head = self.verifier.lm_head
        self.draft_ids = None if ids is None else ids.to(self.device)
        self.draft_vocab_size = self.vocab_size if ids is None else len(ids)
        self.draft_rows = self.draft_bias = None
        if ids is None and (self.drafter is None or self.draft_head == head.weight.dtype):
            return
        pick = (lambda t: t) if ids is None else (lambda t: t.index_select(0, self.draft_ids))
        self.draft_rows = pick(head.weight).to(self.draft_head)
        self.draft_bias = None if head.bias is None else pick(head.bias).to(self.draft_head)

    def draft_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The drafter's logits over its draft vocabulary (the whole vocabulary without one), in x's
        dtype (computed in ``draft_head``'s)."""
        if self.draft_rows is None:
            return self.verifier.lm_head(x)
        rows = self.draft_rows
        return torch.nn.functional.linear(x.to(rows.dtype), rows, self.draft_bias).to(x.dtype)

    def _own_drafter_setting(self) -> None:
        """The drafter module is the caller's and may serve several runners: it takes this runner's
        fast-kernel setting at construction and again at each generation (eager rounds and new
        captures read it then; captured graphs keep what they were captured with)."""
        model = self.drafter.model if self.drafter is not None else None
        if model is not None and (model.fused is not None) != self.fast_kernels:
            model.use_layer_kernels(self.fast_kernels)

    # ------------------------------------------------------------------ one sequence: the Runner contract

    @torch.inference_mode()
    def begin(self, prompt: torch.Tensor, tree: TreeConfig, sampling: SamplingConfig) -> int:
        """A generation in slot 0 (the one-slot case of the slots below)."""
        self._own_drafter_setting()
        if self.tree != tree:
            self.configure(tree)
        if self.use_graphs:
            self._capture_for(1, sampling_kind(sampling.temperature, sampling.top_p))
        self.admit(0, sampling)
        n = int(prompt.shape[0])
        # Captured (or compiled) prefill passes have one static chunk; eagerly the whole prompt is one pass.
        step = PREFILL_CHUNK if self.use_graphs or self.compiled else n
        first = None
        for start in range(0, n, step):
            first = self.prefill(0, prompt[start : start + step], last=start + step >= n)
        return first

    @torch.inference_mode()
    def round(self) -> list[int]:
        return self.step(1)[0]

    # ------------------------------------------------------------------ admission, prefill, release

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
        self.host_len[slot] = 0
        self.host_kind[slot] = sampling_kind(sampling.temperature, sampling.top_p)

    @torch.inference_mode()
    def prefill(self, slot: int, tokens: torch.Tensor, last: bool) -> int | None:
        """The next chunk of slot ``slot``'s prompt (tokens [c] on the device) into its caches. On the
        last chunk the slot turns active and its first new token is returned (else None)."""
        return self.prefill_many([(slot, tokens, last)])[0]

    @torch.inference_mode()
    def prefill_many(self, chunks: list[tuple[int, torch.Tensor, bool]]) -> list[int | None]:
        """Several slots' next prompt chunks (slot, tokens [c_i], last). Eagerly one pass, padded to the
        longest; captured, passes of PREFILL_CHUNK tokens over groups of a power-of-two size (each row
        at its own slot's range and length; padding tokens write past the chunk, where nothing reads
        them). Returns each slot's first new token on its last chunk, else None."""
        if self.use_graphs:
            waves: dict[int, list] = {}  # piece index -> (slot, piece, last) of every chunk that has one
            for slot, tokens, last in chunks:
                pieces = list(tokens.split(PREFILL_CHUNK))
                for i, piece in enumerate(pieces):
                    waves.setdefault(i, []).append((slot, piece, last and i == len(pieces) - 1))
            for wave in waves.values():
                for group in power_of_two_groups(wave):
                    self._prefill_group(group)
        else:
            C = max(int(t.shape[0]) for _, t, _ in chunks)
            bound = 0 if self.compiled else min(max(self.host_len[s] for s, _, _ in chunks) + C, self.slot_size)
            self._prefill_pass(*self._pass_inputs(chunks, C), bound)
        for slot, tokens, _ in chunks:
            self.host_len[slot] += int(tokens.shape[0])
        last = [slot for slot, _, is_last in chunks if is_last]
        firsts = dict(zip(last, self.state.root[last].tolist())) if last else {}  # the one read-back
        return [firsts.get(slot) if is_last else None for slot, _, is_last in chunks]

    def _prefill_group(self, group: list[tuple[int, torch.Tensor, bool]]) -> None:
        """One captured prefill pass over a power-of-two group of rows, each a piece of <= PREFILL_CHUNK."""
        k = len(group)
        key = ("prefill", k)
        if key not in self._graphs:
            self._capture_prefill(k)
        self._graphs[key](*self._pass_inputs(group, PREFILL_CHUNK))

    def _pass_inputs(self, rows: list[tuple[int, torch.Tensor, bool]], width: int) -> tuple[torch.Tensor, ...]:
        """A prefill pass's arguments: tokens [k, width] (each row padded), slots, counts [k], last [k] bool."""
        tokens = torch.stack([torch.nn.functional.pad(t, (0, width - t.shape[0])) for _, t, _ in rows])
        meta = torch.tensor([[s, int(t.shape[0]), int(last)] for s, t, last in rows], device=self.device)
        return tokens, meta[:, 0], meta[:, 1], meta[:, 2].bool()

    def _prefill_pass(self, tokens: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor, last: torch.Tensor,
                      bound: int = 0) -> None:
        """tokens [k, C] (row i's first counts[i] real) of slots [k] at each slot's positions P..; a row
        whose ``last`` is set ends its prompt: the slot's first new token goes to root, and it turns
        active. Reads no host value (a captured pass)."""
        st, S = self.state, self.slot_size
        k, C = tokens.shape
        P = st.past_len[slots]
        ids = torch.arange(C, device=self.device)
        causal = (ids[:, None] >= ids[None, :]).expand(k, C, C)
        logits, feats = self.verifier.forward_cached(tokens, P[:, None] + ids, causal, st.kv, P, key_bound=bound,
                                                     logit_rows=(counts - 1).clamp_min(0)[:, None], slot_ids=slots,
                                                     slot_size=S)
        if self.drafter is not None:
            self.drafter.model.forward_cached(feats, P, counts, None, st.draft_kv, slot_ids=slots, slot_size=S)
        now = P + counts
        st.past_len[slots] = now
        # NUCLEUS handles every request exactly (top_p >= 1 keeps every token); k rows only.
        first = choose_tokens_keyed(logits, st.temperature[slots], st.top_p[slots], st.seed[slots], now[:, None],
                                    NUCLEUS)[:, 0]
        st.root[slots] = torch.where(last, first, st.root[slots])
        st.active[slots] = st.active[slots] | last

    @torch.inference_mode()
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
            for t in (st.past_len, st.root, st.pending, st.pending_count, st.out, st.active, st.temperature, st.top_p,
                      st.seed):
                t[slot] = t[last]
            self.host_len[slot], self.host_kind[slot] = self.host_len[last], self.host_kind[last]
        st.active[last] = False
        st.past_len[last] = 0
        st.pending_count[last] = 0
        self.host_len[last], self.host_kind[last] = 0, GREEDY

    # ------------------------------------------------------------------ the batched round

    def bucket_for(self, occupied: int) -> int:
        return next(b for b in self.buckets if b >= occupied)

    @torch.inference_mode()
    def step(self, occupied: int) -> list[list[int]]:
        """One round over the first ``occupied`` slots (run as its bucket); returns each slot's gained
        tokens (empty for inactive slots)."""
        b = self.bucket_for(occupied)
        kind = max(self.host_kind[:occupied])
        self.ran_eagerly = self.captured = False
        if self.use_graphs:
            tree = self._bucket_tree(b)
            key, before = self._round_key(b, kind, tree), self._pending_bound
            flush = key[-1] == "flush"
            if key in self._graphs or self.capture_now:
                if key not in self._graphs:
                    self._capture_round(b, kind)
                    self.captured = True
                self._graphs[key]()
            else:  # not captured and not worth capturing yet: the captured form, eagerly (bound 0)
                self.ran_eagerly = True
                self._round(b, tree, kind, flush=flush)
            # What the host knows of the pending counts after it (no read-back): a tree round leaves at
            # most min(N, B); a plain step with the drafter's context appended one row, or flushed to one.
            if tree.mode != "ar":
                self._pending_bound = min(tree.tree_size, self.block_size)
            elif self.keep_context and self.drafter is not None:
                self._pending_bound = 1 if flush else before + 1  # flush is False only with a bound
        else:  # eagerly the reference attention stops at the longest slot plus this round's tree or the
            # drafter's block (compiled: one shape); a plain step under a 64-node deployment looked at 64
            # more keys than it has, about 2% of a plain step of the demo pair at 8 slots
            tree = self._bucket_tree(b)
            n = 1 if tree.mode == "ar" else tree.tree_size
            bound = 0 if self.compiled else min(max(self.host_len[:b]) + max(n, self.block_size), self.slot_size)
            self._round(b, tree, kind, bound)
        out = self.state.out[:occupied].tolist()  # the one read-back of the round
        gained = [row[1 : 1 + row[0]] for row in out]
        for slot, tokens in enumerate(gained):
            self.host_len[slot] += len(tokens)
        return gained

    def _bucket_tree(self, b: int) -> TreeConfig:
        chosen = self.bucket_trees.get(b)
        return chosen if chosen is not None else dataclasses.replace(self.tree, tree_size=self.tree_by_bucket[b])

    def _round(self, b: int, tree: TreeConfig, kind: int, bound: int = 0, flush: bool = True) -> None:
        """draft -> expand -> build trees -> verify -> accept -> commit, for slots 0..b-1. The drafter
        and the verifier run once over all slots; the expansion and acceptance are the one-sequence
        functions mapped over the slots (torch.vmap: one batched call each), the tree build takes
        the batch itself. flush: with graphs, whether a plain step's drafter context enters the
        drafter's cache now (see _keep_context; the host decides, see _flushes)."""
        st = self.state
        kv = self._first(st.kv, b)
        P, root = st.past_len[:b], st.root[:b]
        if tree.mode == "ar":
            with self._stage("verify"):
                one = torch.ones(b, 1, 1, dtype=torch.bool, device=self.device)
                logits, feats = self.verifier.forward_cached(root[:, None], P[:, None], one, kv, P, key_bound=bound)
                y = choose_tokens_keyed(logits, st.temperature[:b], st.top_p[:b], st.seed[:b], P[:, None] + 1, kind)
            if self.keep_context and self.drafter is not None:
                with self._stage("draft"):
                    self._keep_context(b, feats, bound, flush)
            with self._stage("accept"):
                self._commit_plain(b, y[:, 0])
            if self.probe_tree is not None and self.observing and self.keep_context:
                with self._stage("probe"):
                    self._probe_scores(b, self.probe_tree, bound)
            return
        self._pending_bound = None  # the round's commit sets each slot's pending count anew
        seen = None  # the tree whose nodes the round reports (a larger one than it verifies, see observed_size)
        probe = self.probe_tree if self.observing and self.keep_context else None  # another family's tree
        n_seen = observed_size(tree)
        report = self.observing and probe is None and n_seen <= OBS_NODES
        with self._stage("draft"):
            z = self.draft(b, bound)
        with self._stage("expand"):
            tables = self._batched_tables(b, root, z[:, : expansion_depth(tree, n_seen if report else 0,
                                                                          self.block_size)], tree)
        with self._stage("tree"):
            trees = _fields(self.build_tree(tables, root, tree.tree_size))
            if report:
                seen = trees if n_seen == tree.tree_size else _fields(self.build_tree(tables, root, n_seen))
                self._report_nodes(b, tables, Tree(*seen))
        if probe is not None:  # from this round's root and drafter pass, before the commit moves them
            with self._stage("probe"):
                self._probe_scores(b, probe, bound, z)
        tokens, _, depths, mask, _ = trees
        with self._stage("verify"):
            logits, feats = self.verifier.forward_cached(tokens, P[:, None] + depths, mask, kv, P, key_bound=bound)
            y = choose_tokens_keyed(logits, st.temperature[:b], st.top_p[:b], st.seed[:b], P[:, None] + depths + 1, kind)
        with self._stage("accept"):
            self._commit(b, trees, y, feats, seen)

    def _probe_scores(self, b: int, tree: TreeConfig, bound: int, z: torch.Tensor | None = None) -> None:
        """The tree ``tree`` would have drafted from the current root, built and scored but not
        verified, reported like a round's nodes without labels (the self-tuning tree's score probe: how
        confident the drafter is on this request, for a tree that is not running). After a plain step
        the drafter's pending context enters its cache on the way, as the next tree round would do
        it; in a tree round (of another family) ``z``, the round's own drafter pass, is reused and
        the round reports the probe's nodes instead of its own."""
        root, n = self.state.root[:b], observed_size(tree)
        z = self.draft(b, bound) if z is None else z
        tables = self._batched_tables(b, root, z[:, : expansion_depth(tree, n, self.block_size)], tree)
        seen = Tree(*_fields(self.build_tree(tables, root, n)))
        self._report_nodes(b, tables, seen)
        self._probe_nodes = (seen.tokens, seen.parents)  # for labels in hindsight (probe_observation)

    def _batched_tables(self, b: int, root: torch.Tensor, z: torch.Tensor, tree: TreeConfig) -> Tables:
        """The expansion for slots 0..b-1 (root [b], z [b, B, H]): the one-slot tables mapped over them."""
        return Tables(*_map(b, lambda r, zz: _fields(self.tables(r, zz, tree)), root[:, None], z))

    def _report_nodes(self, b: int, tables: Tables, seen: Tree) -> None:
        """Each node's path score and ranks of ``seen`` (built from ``tables``) into the state's reports
        for the self-tuning tree (see observation)."""
        st, n = self.state, seen.tokens.shape[1]
        score, m_rank, k_rank = node_paths(tables, seen)
        st.obs_score[:b, :n] = score
        st.obs_rank[:b, 0, :n] = m_rank
        st.obs_rank[:b, 1, :n] = k_rank

    def probe_observation(self, slot: int) -> dict | None:
        """The last round's score probe of ``slot`` (see _probe_scores), as ``observation`` reports a
        round: scores and ranks, no node verified, plus each node's token and parent (0: the root) so
        that the tokens committed from its root on can label it; None when the round ran no probe."""
        tree = self.probe_tree
        if tree is None or not self.observing or observed_size(tree) > OBS_NODES:
            return None
        raw = self.observation(slot, tree)
        tokens, parents = self._probe_nodes
        raw.update(verified=0, tokens=tokens[slot, 1:].tolist(), parents=parents[slot, 1:].tolist())
        return raw

    def draft(self, b: int = 1, bound: int = 0) -> torch.Tensor:
        """Stage 1 for slots 0..b-1: each slot's pending context enters its drafter cache, then its block
        [root, MASK x (B-1)] at positions P..P+B-1 -> z [b, B, H] (pre-norm)."""
        st, B = self.state, self.block_size
        P, count = st.past_len[:b], st.pending_count[:b]
        block = torch.full((b, B), self.mask_token_id, dtype=torch.long, device=self.device)
        block = torch.cat([st.root[:b, None], block[:, 1:]], dim=1)
        pending = st.pending[:b]
        if self.lazy_context and not self.use_graphs:  # only the rows some slot holds (more than a block)
            pending = pending[:, : max(1, int(count.max()))]
        return self.drafter.model.forward_cached(pending, P - count, count,
                                                 self.verifier.embed_tokens(block), self._first(st.draft_kv, b),
                                                 key_bound=bound)

    def tables(self, root: torch.Tensor, z: torch.Tensor, tree: TreeConfig) -> Tables:
        """Stage 2 for one slot: root [1], z [B, H] -> transition tables for the mode (see
        treeflash_export.models.expand)."""
        norm = self.drafter.model.norm
        logits = self.draft_logits(norm(z))
        if tree.mode == "treeflash":
            return treeflash_tables(
                z, logits, root, head=self.drafter.ar_approximation, norm=norm,
                embed_tokens=self.verifier.embed_tokens, lm_head=self.draft_logits,
                top_m=tree.top_m, top_k=tree.top_k, temperature=tree.drafter_temperature, fused=self.fused,
                topk_kernel=self.fast_kernels, vocab_ids=self.draft_ids,
            )
        return marginal_tables(logits, tree.top_k, tree.drafter_temperature, topk_kernel=self.fast_kernels,
                               vocab_ids=self.draft_ids)

    def _commit(self, b: int, trees: tuple, y: torch.Tensor, feats: torch.Tensor, seen: tuple | None = None) -> None:
        """Accept each slot's deepest matching path (tau nodes) and commit it, in fixed shapes: its K/V
        move to slots P..P+tau-1 (no RoPE fix-up: a node at depth d already sits at position P + d),
        its features become the drafter's pending context, its drafts and the bonus go to out. An
        inactive slot keeps its state (its cache past its length may change: nothing reads it before
        it is written again)."""
        st = self.state
        L = min(self.block_size, trees[0].shape[1])
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
        if seen is not None:  # the reported tree's nodes on the accepted path
            st.obs_accepted[:b, : seen[0].shape[1]] = on_accepted_path(Tree(*seen), drafts, tau)

    def _keep_context(self, b: int, feats: torch.Tensor, bound: int, flush: bool = True) -> None:
        """Plain decoding inside a speculative generation: the step's own features join the pending
        context, so a tree round may follow. They are appended while the pending buffer has room, and
        the next drafter pass takes them all at once: eagerly on the CPU the buffer holds PREFILL_CHUNK
        rows and the host's bound on the counts decides here; with CUDA graphs it holds the block's B
        rows and the host decided before choosing the graph (``flush``: two captured plain steps, one
        that appends and one that flushes). Once it is full, the pending context enters the drafter's
        cache and the step's features replace it. So a plain step runs the drafter once in B steps
        rather than every step (on an H200 at Qwen3-8B's shapes a drafter pass is 16% of a plain step)."""
        st = self.state
        count, active = st.pending_count[:b], st.active[:b]
        if self.use_graphs and not flush:
            # Every slot's row `count` (clamped: an inactive slot may hold B rows; the host's bound keeps
            # every active one below B); only active slots count it.
            rows = count.clamp_max(st.pending.shape[1] - 1)
            st.pending[self._slot_rows[:b], rows] = feats[:, 0].to(st.pending.dtype)
            st.pending_count[:b] += active
            return
        if self.lazy_context and not self.use_graphs:
            if self._pending_bound is None:
                self._pending_bound = int(st.pending_count.max())
            if self._pending_bound < st.pending.shape[1]:
                # Row `count` of every slot (an inactive slot's row there is past what it holds, so
                # writing it is harmless); only active slots count it.
                st.pending[self._slot_rows[:b], count] = feats[:, 0].to(st.pending.dtype)
                st.pending_count[:b] += active
                self._pending_bound += 1
                return
            self._pending_bound = 1  # the buffer is full: it enters the drafter's cache now
        self.drafter.model.forward_cached(st.pending[:b], st.past_len[:b] - count, count, None,
                                          self._first(st.draft_kv, b), key_bound=bound)
        st.pending[:b, :1] = torch.where(active[:, None, None], feats[:, :1].to(st.pending.dtype), st.pending[:b, :1])
        st.pending_count[:b] = torch.where(active, torch.ones_like(count), count)

    def observation(self, slot: int, tree: TreeConfig) -> dict | None:
        """The last round's nodes of ``slot`` for the self-tuning tree (host lists, root excluded, tree
        order): path scores, largest parent row and child rank, accepted, over the larger tree the round
        reported (observed_size), and ``verified``: how many of its nodes, best first, the round
        verified (the rest are labelled only where the accepted path shows them); None when not
        observed."""
        n = observed_size(tree)
        if not self.observing or tree.mode == "ar" or n > OBS_NODES:
            return None
        st = self.state
        rows = torch.cat([st.obs_score[slot, 1:n], st.obs_rank[slot, :, 1:n].float().flatten(),
                          st.obs_accepted[slot, 1:n].float()]).tolist()  # one read-back
        k = n - 1
        return {"scores": rows[:k], "m_rank": rows[k : 2 * k], "k_rank": rows[2 * k : 3 * k],
                "accepted": rows[3 * k :], "verified": tree.tree_size - 1}

    def _commit_plain(self, b: int, token: torch.Tensor) -> None:
        """Plain decoding's commit: the one node's K/V already sit at slot P; each active slot gains its token."""
        st = self.state
        active = st.active[:b]
        gained = active.long()
        st.out[:b, 0] = gained
        st.out[:b, 1] = token
        st.past_len[:b] += gained
        st.root[:b] = torch.where(active, token, st.root[:b])

    # ------------------------------------------------------------------ the self-tuning tree's probe

    @contextlib.contextmanager
    def probing(self, b: int, prompt_tokens: int = 64):
        """Slots 0..b-1 hold a dummy prompt of ``prompt_tokens`` tokens while the self-tuning tree times a
        round's parts (``time_part``); every slot is freed after, so no request may hold one."""
        if bool(self.state.active[:b].any()):
            raise RuntimeError("internal error: the cost probe needs free slots; a request holds one")
        ids = torch.arange(1, prompt_tokens + 1, device=self.device) % self.vocab_size
        self._probe_memo: dict = {}
        try:
            for slot in range(b):
                self.admit(slot, SamplingConfig())
            self.prefill_many([(slot, ids, True) for slot in range(b)])
            yield self
        finally:
            for slot in reversed(range(b)):
                self.release(slot, slot + 1)
            self._probe_memo = {}

    @torch.inference_mode()
    def time_part(self, part: str, b: int, **params) -> float:
        """Seconds of one part of a round over slots 0..b-1 (inside ``probing``), synchronised; the
        committed state is put back after, so every call times the same lengths. Parts (the tuner's
        probe protocol, treeflash_runtime.tuner.cost): 'ar', 'draft', 'verify' (nodes=N), 'expand'
        (top_m=M, top_k=K; mode='chain'; mode='marginal', top_k=K), 'tree' (tree_size=N), 'round' (setting=...). With CUDA
        graphs on, each part is captured once and its replay is timed: the rounds that serve are
        replays, whose cost an eager call (launches from Python) would overstate many times."""
        st = self.state
        with self._kept(st.past_len, st.root, st.pending, st.pending_count, st.out, st.active) as restore:
            run = lambda: self._run_part(part, b, params)  # noqa: E731
            if self.use_graphs:
                self._probe_inputs(part, b)  # the drafter pass and tables the parts start from, not timed
                key = ("probe", part, b, tuple(sorted((k, str(v)) for k, v in params.items())))
                if key not in self._probe_memo:
                    self._probe_memo[key] = self._capture(run, (), restore)
                    restore()
                run = self._probe_memo[key]
            self._sync()
            t0 = time.perf_counter()
            run()
            self._sync()
            return time.perf_counter() - t0

    def _probe_inputs(self, part: str, b: int) -> None:
        """The drafter pass (and a tree's tables) that the expansion and tree parts start from, made
        once per probing session outside any capture."""
        if part in ("expand", "tree") and "z" not in self._probe_memo:
            self._run_part("draft-for-probe", b, {})
        if part == "tree" and "tables" not in self._probe_memo:
            self._run_part("tree-tables", b, {})

    def _run_part(self, part: str, b: int, params: dict) -> None:
        """One part of time_part, on slots 0..b-1 as probing left them."""
        st, memo = self.state, self._probe_memo
        P, root = st.past_len[:b], st.root[:b]
        bound = 0 if self.compiled else min(max(self.host_len[:b]) + 2 * OBS_NODES + self.block_size, self.slot_size)

        def tables_for(cfg):  # the expansion, from one drafter pass per probing session
            if "z" not in memo:
                memo["z"] = self.draft(b, bound)
            return self._batched_tables(b, root, memo["z"], cfg)

        def grid(top_m, top_k, mode="treeflash"):  # a grid point, within a draft vocabulary smaller than M or K
            return TreeConfig(mode=mode, top_m=min(top_m, self.draft_vocab_size),
                              top_k=min(top_k, self.draft_vocab_size))

        def tree_tables():  # what the tree parts build from: TreeFlash's tables, or the marginal tree's
            return tables_for(grid(4, 16) if self.has_head else grid(1, 16, "marginal"))

        if part == "ar":
            self._round(b, TreeConfig(mode="ar"), GREEDY, bound)
        elif part == "round":
            s = params["setting"]
            self._round(b, TreeConfig(mode=s.mode, tree_size=s.tree_size, top_m=s.top_m, top_k=s.top_k).resolved(
                self.block_size), GREEDY, bound)
        elif part == "draft":
            self.draft(b, bound)
        elif part == "draft-for-probe":
            memo["z"] = self.draft(b, bound)
        elif part == "tree-tables":
            memo["tables"] = tree_tables()
        elif part == "verify":
            n = int(params["nodes"])
            ids = torch.arange(n, device=self.device)
            mask = (ids[:, None] >= ids[None, :]).expand(b, n, n)
            self.verifier.forward_cached(root[:, None].expand(b, n), P[:, None] + ids, mask, self._first(st.kv, b), P,
                                         key_bound=bound)
        elif part == "expand":
            mode = params.get("mode", "treeflash")
            tables_for(TreeConfig(mode="chain").resolved(self.block_size) if mode == "chain" else
                       grid(int(params.get("top_m", 1)), int(params["top_k"]), mode))
        elif part == "tree":
            if "tables" not in memo:
                memo["tables"] = tree_tables()
            self.build_tree(memo["tables"], root, int(params["tree_size"]))
        else:
            raise ValueError(f"unknown part {part!r}")

    # ------------------------------------------------------------------ compilation, CUDA graphs, timing

    def _compile_steps(self) -> None:
        """Wraps the prefill pass and the round from outside (the model code stays eager and readable).
        Shapes are static per setting, so each compiles once; Inductor's cache lives under the
        project's cache folder (TREEFLASH_CACHE), so a second start reuses it."""
        _project_cache("TORCHINDUCTOR_CACHE_DIR", "inductor")
        for name in ("_prefill_pass", "_round"):
            setattr(self, name, torch.compile(getattr(self, name), dynamic=False))

    @contextlib.contextmanager
    def _stage(self, name: str):
        """Times a stage when a benchmark asks: inside a timing capture (graph_stage_times) with
        CUDA events recorded into the graph; eagerly with ``timer`` set, synchronising around it."""
        if self._marks is not None and torch.cuda.is_current_stream_capturing():
            start, end = (torch.cuda.Event(enable_timing=True, external=True) for _ in range(2))
            start.record()
            yield
            end.record()
            self._marks.append((name, start, end))
            return
        if self.timer is None:
            yield
            return
        self._sync()
        t0 = time.perf_counter()
        yield
        self._sync()
        self.timer[name] = self.timer.get(name, 0.0) + time.perf_counter() - t0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def _kept(self, *tensors: torch.Tensor):
        """The state in ``tensors`` is put back when the block ends; the block gets restore() to put
        it back earlier too (before each warm-up or replay of a scratch pass)."""
        saved = [t.clone() for t in tensors]

        def restore():
            for dst, src in zip(tensors, saved):
                dst.copy_(src)
            self._pending_bound = None  # the pending counts may be others now

        try:
            yield restore
        finally:
            restore()

    def graph_stage_times(self, count: int, b: int = 1) -> dict[str, float]:
        """Milliseconds per stage of the current setting's round over b slots as it runs in a CUDA
        graph: a separate capture with timing events between the stages, replayed ``count`` times
        from the current state (restored before each replay, so the committed lengths stay put)."""
        st = self.state
        self._marks = []
        try:
            with self._kept(st.past_len, st.root, st.pending, st.pending_count, st.out) as restore:
                kind = max(self.host_kind[:b])
                graph = self._capture(lambda: self._round(b, self._bucket_tree(b), kind), (), restore)
                totals = dict.fromkeys((name for name, _, _ in self._marks), 0.0)
                for _ in range(count):
                    restore()
                    graph()
                    torch.cuda.synchronize(self.device)
                    for name, start, end in self._marks:
                        totals[name] += start.elapsed_time(end)
        finally:
            self._marks = None
        return {name: ms / count for name, ms in totals.items()}

    def _capture(self, fn, args, reset) -> _Captured:
        """fn(*args) as a replayable graph in this runner's memory pool. (The CPU tests put an eager
        stand-in here, so that the functions and arguments CUDA captures run, and are checked, on CPU.)"""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return _Captured(fn, args, self._pool, reset)

    def _round_key(self, b: int, kind: int, tree: TreeConfig | None = None) -> tuple:
        """A round graph's key: bucket, tree setting (with the bucket's size; tree: that setting, when
        the caller has it) and sampling kind, never sampling values (those are device data); for a
        plain step with the drafter's context, whether it appends or flushes (a last "flush")."""
        tree = self._bucket_tree(b) if tree is None else tree
        key = ("round", b, tree, kind, self.observing, self.keep_context)
        return key + ("flush",) if self._flushes(tree) else key

    def _flushes(self, tree: TreeConfig) -> bool:
        """Whether a captured plain step with the drafter's context runs the drafter over the pending
        rows now: when they might not hold one more (the host's bound, no read-back). False for every
        other round."""
        if tree.mode != "ar" or not self.keep_context or self.drafter is None:
            return False
        bound = self._pending_bound
        return bound is None or bound >= self.state.pending.shape[1]

    @contextlib.contextmanager
    def _scratch(self):
        """Warm-up and capture run real passes with every slot inactive and no length moved for good:
        the state they touch is put back after (an inactive round only writes cache slots past each
        slot's length and the output rows)."""
        st = self.state
        with self._kept(st.active, st.past_len, st.root, st.pending_count) as restore:
            st.active.zero_()
            yield lambda: (restore(), st.active.zero_())

    def _capture_round(self, b: int, kind: int) -> None:
        t0 = time.perf_counter()
        tree = self._bucket_tree(b)
        key = self._round_key(b, kind, tree)
        flush = key[-1] == "flush"  # decided now: the scratch state put back below forgets the bound
        with self._scratch() as reset:
            self._graphs[key] = self._capture(lambda: self._round(b, tree, kind, flush=flush), (), reset)
        self.log(f"captured a CUDA graph ({_describe(tree)}, {b} slot{'s' if b > 1 else ''}, "
                 f"{('greedy', 'sampling', 'sampling with top-p')[kind]}) in {time.perf_counter() - t0:.1f}s")

    def _capture_prefill(self, k: int) -> None:
        """The prefill pass over k rows of PREFILL_CHUNK tokens; warm-up and capture run it on slots
        0..k-1 with nothing to keep (counts 0: lengths and roots stay; K/V land past each length)."""
        t0 = time.perf_counter()
        dev = self.device
        args = (torch.zeros(k, PREFILL_CHUNK, dtype=torch.long, device=dev), torch.arange(k, device=dev),
                torch.zeros(k, dtype=torch.long, device=dev), torch.zeros(k, dtype=torch.bool, device=dev))
        with self._scratch() as reset:
            self._graphs["prefill", k] = self._capture(self._prefill_pass, args, reset)
        self.log(f"captured a CUDA graph (prefill, {k} row{'s' if k > 1 else ''}) in {time.perf_counter() - t0:.1f}s")

    def _capture_for(self, b: int, kind: int) -> None:
        """What a one-sequence generation needs (captured on its first begin): prefill and the round."""
        if ("prefill", 1) not in self._graphs:
            self._capture_prefill(1)
        if self.capture_now and self._round_key(b, kind) not in self._graphs:
            self._capture_round(b, kind)

    def capture_all(self) -> None:
        """Every graph serving can need, at start-up (no stall mid-stream): the round of each bucket in
        each sampling kind, and prefill passes over each power-of-two group of rows."""
        todo = [("prefill", k) for k in bucket_sizes(self.max_batch) if k & (k - 1) == 0]
        todo += [("round", b, kind) for b in self.buckets for kind in KINDS]
        t0 = time.perf_counter()
        for i, key in enumerate(todo, 1):
            self.log(f"capturing CUDA graphs {i}/{len(todo)}")
            if key[0] == "prefill":
                if key not in self._graphs:
                    self._capture_prefill(key[1])
            elif self._round_key(key[1], key[2]) not in self._graphs:
                self._capture_round(key[1], key[2])
        self.log(f"captured {len(todo)} CUDA graphs in {time.perf_counter() - t0:.1f}s")


def _describe(tree: TreeConfig) -> str:
    return "plain decoding" if tree.mode == "ar" else f"{tree.mode} N={tree.tree_size}"


class _Captured:
    """fn(*args) captured once in a CUDA graph with static copies of its tensor arguments;
    calling copies the new arguments in and replays. fn's effects are its writes to state."""

    def __init__(self, fn, args, pool, reset, warmup: int = 2):
        """reset() puts the scratch state back before each warm-up run and before the capture."""
        self.args = [a.clone() for a in args]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up off the default stream, as capture requires
            for _ in range(warmup):
                reset()
                fn(*self.args)
        torch.cuda.current_stream().wait_stream(stream)
        reset()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            fn(*self.args)
        reset()

    def __call__(self, *args) -> None:
        for dst, src in zip(self.args, args):
            dst.copy_(src)
        self.graph.replay()


def _map(b: int, fn, *args) -> tuple:
    """fn over the slots (dim 0 of every argument): torch.vmap, or a plain call for one slot (vmap's
    per-operator cost is all overhead there)."""
    if b > 1:
        return torch.vmap(fn)(*args)
    return tuple(out[None] for out in fn(*(a[0] for a in args)))


def _fields(x) -> tuple:
    """A Tables or Tree as the tuple of its tensors (what torch.vmap maps)."""
    return tuple(getattr(x, f.name) for f in dataclasses.fields(x))
