"""PyTorch backend: one round code for one sequence and for many requests (request slots).

The runner executes what it is given: ``admit`` / ``prefill`` / ``release`` move requests in and
out of packed slots (pytorch.state), and ``step(plan)`` runs one round over the occupied slots as
their batch bucket (1, 2, 4, ..., max_batch) and returns a RoundReport. The round itself is the
stage functions (pytorch.stages); on CUDA each (bucket, tree, sampling kind, report) round and each
prefill group size is captured once as a graph and replayed (pytorch.graphs). A single sequence is
the one-slot case: the same prefill, the same round, the same captures.

Sampling is keyed (treeflash_runtime.sampling.choose_tokens_keyed): a request's tokens depend on
its prompt, settings and seed only, whatever shares its rounds and whatever its tree. Graph keys
hold the sampling kind (greedy, sampling, sampling with top-p), never the values: temperature,
top-p and seed are per-slot device tensors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time

import torch

from treeflash_export.config import SamplingConfig, TreeConfig
from treeflash_export.errors import ConfigError
from treeflash_export.models import TreeVerifier

from ...plan import PREFILL_CHUNK, NodeReport, RoundPlan, RoundReport, checked_tree
from ...sampling import GREEDY, NUCLEUS, SAMPLE
from ..base import Runner
from ..slots import bucket_sizes, power_of_two_groups, tree_sizes_by_bucket
from . import probe as _probe
from .draft_head import DraftHead, draft_head_default
from .graphs import GraphCache, kept, round_key
from .stages import RoundStages
from .state import OBS_NODES, SlotState, prefill_pass

KINDS = (GREEDY, SAMPLE, NUCLEUS)


def fast_kernels_default(device: torch.device, compiled: bool) -> bool:
    """The fast kernels are on by default where they run as Triton kernels (CUDA, triton installed),
    unless the steps are compiled: then Inductor does the fusing, over the modules."""
    if device.type != "cuda" or compiled:
        return False
    from treeflash_kernels import layer_ops

    return layer_ops.triton is not None


def _project_cache(variable: str, name: str) -> None:
    """Compiled code goes under the project's cache folder (TREEFLASH_CACHE), unless the user's
    environment names another place: a second start reuses it, and one folder holds all of it."""
    import os

    from treeflash_export.smollm import cache_root

    os.environ.setdefault(variable, str(cache_root() / name))


class TorchRunner(Runner):
    """The model pair on PyTorch with ``max_batch`` request slots (1: one sequence). ``tree``: the
    deployment's tree setting, which sizes the graph workspace and is captured for every bucket at
    start (serving); ``tree_size_by_batch`` may give a smaller tree size for larger buckets."""

    name = "torch"

    def __init__(self, verifier_hf, drafter=None, *, capacity: int, max_batch: int = 1, tree: TreeConfig | None = None,
                 tree_size_by_batch: dict[int, int] | None = None, fused: bool = True, cuda_graphs: bool = True,
                 compile: bool = False, fast_kernels: bool | None = None, capture_at_start: bool = True,
                 draft_vocab: int | None = None, draft_head: torch.dtype | None = None, log=None):
        """verifier_hf: a Hugging Face causal LM; drafter: a TreeFlashDrafter or None (plain decoding only).
        fused: the TreeFlash head through torch.ops.treeflash.mlp_expand (the Triton kernels on CUDA,
        the PyTorch reference elsewhere) rather than the module composition.
        cuda_graphs: on CUDA, capture prefill passes and rounds once each and replay them; ignored
        elsewhere. compile: torch.compile the prefill pass and the round, with its cache under the
        project's cache folder. fast_kernels: the decoder layers through merged projections and the
        layer kernels, the expansion's top-k in one read of the logits and the trees built in one
        kernel, each with a PyTorch reference; None = where they run as Triton kernels (CUDA) and the
        steps are not compiled. capture_at_start: with a deployment tree and graphs on, capture
        every graph serving can need now (capture_all) rather than on first use. draft_vocab: how
        many tokens the drafter ranks (pytorch.draft_head.DraftHead). draft_head: the dtype of the
        expansion's LM head rows (None: draft_head_default). log: progress lines."""
        if max_batch < 1:
            raise ConfigError(f"--max-batch must be >= 1, got {max_batch}")
        self.max_batch = int(max_batch)
        self.drafter = drafter
        tap_ids = drafter.cfg.target_layer_ids if drafter is not None else ()
        self.verifier = TreeVerifier(verifier_hf, tap_ids)
        w = self.verifier.lm_head.weight
        self.device, self.dtype = w.device, w.dtype
        self.compiled = bool(compile)
        self.fast_kernels = bool(fast_kernels_default(self.device, compile) if fast_kernels is None else fast_kernels)
        self.verifier.use_layer_kernels(self.fast_kernels)
        if self.fast_kernels:
            _project_cache("TRITON_CACHE_DIR", "triton")  # the kernels compile on first use
        self._own_drafter_setting()
        self.vocab_size = self.verifier.vocab_size
        self.head = DraftHead(self.verifier.lm_head, drafter, self.vocab_size, draft_vocab,
                              draft_head_default(self.device, self.dtype) if draft_head is None else draft_head)
        self.draft_vocab_size, self.draft_head = self.head.size, self.head.dtype
        self.block_size = drafter.cfg.block_size if drafter is not None else 1
        self.mask_token_id = drafter.cfg.mask_token_id if drafter is not None else -1
        self.has_head = drafter is not None and drafter.ar_approximation is not None
        self.capacity = int(capacity)
        if self.capacity < 2:
            raise ConfigError(f"--max-seq-len {capacity} is too small")
        self.log = log or (lambda msg: None)
        self.buckets = bucket_sizes(self.max_batch)
        # Eagerly (no graph, no compile) the pending drafter context holds up to PREFILL_CHUNK rows, so
        # plain steps that keep the context append their features and a drafter pass takes many at once.
        lazy = self.device.type == "cpu" and not compile
        self.slots = SlotState(self.verifier, drafter, max_batch=self.max_batch, capacity=self.capacity,
                               block_size=self.block_size, dtype=self.dtype, device=self.device, lazy_context=lazy,
                               workspace_rows=tree.tree_size if tree is not None else 64,
                               graphs=bool(cuda_graphs) and self.device.type == "cuda")
        self.state, self.slot_size = self.slots.state, self.slots.slot_size
        self.occupied = 0
        self.stages = RoundStages(self.verifier, drafter, self.head, self.slots, fused=fused,
                                  fast_kernels=self.fast_kernels, use_graphs=False, lazy_context=lazy)
        self.graphs = GraphCache()
        self.use_graphs = bool(cuda_graphs) and self.device.type == "cuda"
        self._prefill_pass = functools.partial(prefill_pass, self.verifier, self.drafter, self.slots)
        self._round = self.stages.run
        if self.compiled:
            _project_cache("TORCHINDUCTOR_CACHE_DIR", "inductor")
            # Wrapped from outside (the model code stays eager); shapes are static per setting.
            self._prefill_pass = torch.compile(self._prefill_pass, dynamic=False)
            self._round = torch.compile(self._round, dynamic=False)
        # The deployment's tree per bucket (request slots), or none (one sequence: each plan brings it).
        self.deployment: dict[int, TreeConfig] = {}
        self.max_tree_size = 64
        if tree is not None:
            tree = checked_tree(self, tree)
            sizes = tree_sizes_by_bucket(self.buckets, tree, tree_size_by_batch or {})
            self.deployment = {b: dataclasses.replace(tree, tree_size=n) for b, n in sizes.items()}
            self.max_tree_size = max(sizes.values())
            if self.use_graphs and capture_at_start:
                self.capture_all()

    @property
    def use_graphs(self) -> bool:
        return self._use_graphs

    @use_graphs.setter
    def use_graphs(self, on: bool) -> None:
        self._use_graphs = self.stages.use_graphs = bool(on)

    def _own_drafter_setting(self) -> None:
        """The drafter module is the caller's and may serve several runners: it takes this runner's
        fast-kernel setting at construction and at each admission (eager rounds and new captures
        read it then; captured graphs keep what they were captured with)."""
        model = self.drafter.model if self.drafter is not None else None
        if model is not None and (model.fused is not None) != self.fast_kernels:
            model.use_layer_kernels(self.fast_kernels)

    # ------------------------------------------------------------------ slots: admit, prefill, release

    @torch.inference_mode()
    def admit(self, slot: int, sampling: SamplingConfig) -> None:
        """Slot ``slot`` (the next free one: slots are packed) takes a new request; it stays inactive
        until its prefill is done."""
        if not 0 <= slot <= self.occupied or slot >= self.max_batch:
            raise ConfigError(f"internal error: slot {slot} is not the next free one of {self.max_batch}")
        self._own_drafter_setting()
        self.occupied = max(self.occupied, slot + 1)  # held even if its settings fail below: released as any
        self.slots.admit(slot, sampling)

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
        slots = self.slots
        if self.use_graphs or self.compiled:
            waves: dict[int, list] = {}  # piece index -> (slot, piece, last) of every chunk that has one
            for slot, tokens, last in chunks:
                pieces = list(tokens.split(PREFILL_CHUNK))
                for i, piece in enumerate(pieces):
                    waves.setdefault(i, []).append((slot, piece, last and i == len(pieces) - 1))
            for wave in waves.values():
                for group in power_of_two_groups(wave):
                    if self.use_graphs:
                        key = ("prefill", len(group))
                        if key not in self.graphs:
                            self._capture_prefill(len(group))
                        self.graphs[key](*slots.pass_inputs(group, PREFILL_CHUNK))
                    else:
                        self._prefill_pass(*slots.pass_inputs(group, PREFILL_CHUNK), 0)
        else:
            C = max(int(t.shape[0]) for _, t, _ in chunks)
            bound = min(max(slots.host_len[s] for s, _, _ in chunks) + C, self.slot_size)
            self._prefill_pass(*slots.pass_inputs(chunks, C), bound)
        for slot, tokens, _ in chunks:
            slots.host_len[slot] += int(tokens.shape[0])
        last = [slot for slot, _, is_last in chunks if is_last]
        firsts = dict(zip(last, self.state.root[last].tolist())) if last else {}  # the one read-back
        return [firsts.get(slot) if is_last else None for slot, _, is_last in chunks]

    @torch.inference_mode()
    def release(self, slot: int) -> None:
        """Frees ``slot``; the last occupied slot (if another) moves into it (pytorch.state.SlotState)."""
        if not 0 <= slot < self.occupied:
            raise ConfigError(f"internal error: slot {slot} is not occupied ({self.occupied} are)")
        self.slots.release(slot, self.occupied)
        self.occupied -= 1

    # ------------------------------------------------------------------ the round

    @torch.inference_mode()
    def step(self, plan: RoundPlan) -> RoundReport:
        """One round of ``plan`` over the occupied slots (run as their bucket)."""
        t0 = time.perf_counter()
        occupied, slots = self.occupied, self.slots
        b = self.bucket_for(occupied)
        kind = max(slots.host_kind[:occupied])
        tree = plan.tree
        if tree.tree_size > max(self.max_tree_size, 1) and tree.mode != "chain":
            raise ConfigError(f"a tree of {tree.tree_size} nodes is larger than this runner's {self.max_tree_size}")
        context = plan.keep_context and self.drafter is not None
        args = dict(report=plan.report_nodes, keep_context=context)
        captured = eager = False
        if self.use_graphs:
            flush = self._flushes(tree, context)
            key = round_key(b, tree, kind, plan.report_nodes, ("flush" if flush else "append") if context else None)
            before = slots.pending_bound
            if key in self.graphs or plan.may_capture:
                if key not in self.graphs:
                    self.capture_round(key, b, tree, kind, dict(args, flush=flush))
                    captured = True
                self.graphs[key]()
            else:  # not captured and not worth capturing yet: the captured form, eagerly (bound 0)
                eager = True
                self._round(b, tree, kind, flush=flush, **args)
            # What the host knows of the pending counts after it (no read-back): a tree round leaves at
            # most min(N, B); a plain step with the drafter's context appended one row, or flushed to one.
            if tree.mode != "ar":
                slots.pending_bound = min(tree.tree_size, self.block_size)
            elif context:
                slots.pending_bound = 1 if flush else before + 1  # flush is False only with a bound
        else:  # eagerly attention stops at the longest slot plus this round's tree or the drafter's block
            n = 1 if tree.mode == "ar" else tree.tree_size
            bound = 0 if self.compiled else min(max(slots.host_len[:b]) + max(n, self.block_size), self.slot_size)
            self._round(b, tree, kind, bound, **args)
        out = self.state.out[:occupied].tolist()  # the one read-back of the round
        gained = [row[1 : 1 + row[0]] for row in out]
        for slot, tokens in enumerate(gained):
            slots.host_len[slot] += len(tokens)
        nodes = None
        if plan.report_nodes and tree.mode != "ar" and tree.tree_size <= OBS_NODES:
            nodes = self._node_reports(occupied, tree.tree_size)
        return RoundReport(tree=tree, gained=gained, seconds=time.perf_counter() - t0, captured=captured, eager=eager,
                           nodes=nodes)

    def _node_reports(self, occupied: int, n: int) -> list[NodeReport]:
        """Each occupied slot's verified nodes, root excluded (one read-back for all of them)."""
        st, k = self.state, n - 1
        rows = torch.cat([st.obs_score[:occupied, 1:n], st.obs_rank[:occupied, :, 1:n].float().flatten(1),
                          st.obs_accepted[:occupied, 1:n].float()], dim=1).tolist()
        return [NodeReport(r[:k], r[k : 2 * k], r[2 * k : 3 * k], r[3 * k :]) for r in rows]

    def _flushes(self, tree: TreeConfig, context: bool) -> bool:
        """Whether a captured plain step with the drafter's context runs the drafter over the pending
        rows now: when they might not hold one more (the host's bound, no read-back)."""
        if tree.mode != "ar" or not context:
            return False
        bound = self.slots.pending_bound
        return bound is None or bound >= self.state.pending.shape[1]

    def forget_pending_bound(self) -> None:
        self.slots.pending_bound = None  # the pending counts may be others now

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ captures, probes, timing

    @contextlib.contextmanager
    def _scratch(self):
        """Warm-up and capture run real passes with every slot inactive and no length moved for good:
        the state they touch is put back after (an inactive round only writes cache slots past each
        slot's length and the output rows)."""
        st = self.state
        with kept(st.active, st.past_len, st.root, st.pending_count, after=self.forget_pending_bound) as restore:
            st.active.zero_()
            yield lambda: (restore(), st.active.zero_())

    def capture_round(self, key: tuple, b: int, tree: TreeConfig, kind: int, args: dict) -> None:
        """The round of ``tree`` over b slots (``args``: RoundStages.run's keywords) as the graph at
        ``key`` (graphs.round_key), replayed by every later round with that key."""
        t0 = time.perf_counter()
        with self._scratch() as reset:
            self.graphs.add(key, lambda: self._round(b, tree, kind, **args), (), reset)
        what = "plain decoding" if tree.mode == "ar" else f"{tree.mode} N={tree.tree_size}"
        self.log(f"captured a CUDA graph ({what}, {b} slot{'s' if b > 1 else ''}, "
                 f"{('greedy', 'sampling', 'sampling with top-p')[kind]}) in {time.perf_counter() - t0:.1f}s")

    def _capture_prefill(self, k: int) -> None:
        """The prefill pass over k rows of PREFILL_CHUNK tokens; warm-up and capture run it on slots
        0..k-1 with nothing to keep (counts 0: lengths and roots stay; K/V land past each length)."""
        t0 = time.perf_counter()
        dev = self.device
        args = (torch.zeros(k, PREFILL_CHUNK, dtype=torch.long, device=dev), torch.arange(k, device=dev),
                torch.zeros(k, dtype=torch.long, device=dev), torch.zeros(k, dtype=torch.bool, device=dev))
        with self._scratch() as reset:
            self.graphs.add(("prefill", k), self._prefill_pass, args, reset)
        self.log(f"captured a CUDA graph (prefill, {k} row{'s' if k > 1 else ''}) in {time.perf_counter() - t0:.1f}s")

    def capture_all(self) -> None:
        """Every graph a fixed deployment can need, at start-up (no stall mid-stream): the round of
        each bucket in each sampling kind, and prefill passes over each power-of-two group of rows."""
        todo = [("prefill", k) for k in self.buckets if k & (k - 1) == 0]
        todo += [("round", b, kind) for b in self.buckets for kind in KINDS]
        t0 = time.perf_counter()
        for i, item in enumerate(todo, 1):
            self.log(f"capturing CUDA graphs {i}/{len(todo)}")
            if item[0] == "prefill":
                if item not in self.graphs:
                    self._capture_prefill(item[1])
                continue
            b, kind = item[1], item[2]
            key = round_key(b, self.deployment[b], kind, False, None)
            if key not in self.graphs:
                self.capture_round(key, b, self.deployment[b], kind, {})
        self.log(f"captured {len(todo)} CUDA graphs in {time.perf_counter() - t0:.1f}s")

    def probing(self, b: int, prompt_tokens: int = 64):
        """A CostProbe over slots 0..b-1 (pytorch.probe.probing)."""
        return _probe.probing(self, b, prompt_tokens)

    def stage_times(self, plan: RoundPlan, count: int, in_graph: bool | None = None) -> dict[str, float]:
        """Milliseconds per stage of ``plan``'s round over the occupied slots, ``count`` rounds from the
        current state (restored before each, so the committed lengths stay put): eagerly and
        synchronised, or (in_graph; default: where graphs are on) a separate capture with timing
        events between the stages."""
        st = self.state
        b = self.bucket_for(self.occupied)
        kind = max(self.slots.host_kind[: self.occupied])
        totals: dict[str, float] = {}
        marks: list | None = [] if (self.use_graphs if in_graph is None else in_graph) else None
        with kept(st.past_len, st.root, st.pending, st.pending_count, st.out, after=self.forget_pending_bound) as restore:
            with _probe.stage_timer(self.stages, totals, self.sync, marks):
                run = lambda: self.stages.run(b, plan.tree, kind)  # noqa: E731
                if marks is not None:
                    run = self.graphs.capture(run, (), restore)
                for _ in range(count):
                    restore()
                    run()
                    self.sync()
                    for name, start, end in marks or ():  # the events a replay recorded again
                        totals[name] = totals.get(name, 0.0) + start.elapsed_time(end) / 1e3
        return {name: 1e3 * s / count for name, s in totals.items()}
