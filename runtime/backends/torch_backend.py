"""PyTorch backend: the model definitions, with the whole round resident on the device.

A round reads and writes only preallocated tensors (``DeviceState``) and never a host
value, so on CUDA it is captured once as a CUDA graph and replayed (``cuda_graphs``);
the host reads back one small buffer per round (the tokens gained and their count).
Elsewhere, and with graphs off, the same functions run eagerly: that is how the tests
prove the device-resident round exact on CPU.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from treeflash_export.config import SamplingConfig, TreeConfig
from treeflash_export.errors import ConfigError
from treeflash_export.models import TreeVerifier
from treeflash_export.models.expand import marginal_tables, treeflash_tables
from treeflash_export.tree import Tables, Tree, build_tree

from ..sampling import accept, choose_tokens
from .base import Runner, allocate_caches

# Prompt tokens per prefill pass when prefill is captured (CUDA graphs); eager prefill takes the
# whole prompt at once. The caches carry this many spare slots so padded passes never overflow.
PREFILL_CHUNK = 256


@dataclass
class DeviceState:
    """What a round reads and writes, preallocated once per runner (graphs keep their addresses).

    kv        [L, 2, Hkv, S', D]  verifier cache; slots < past_len are committed
    draft_kv  [Ld, 2, Hkv, S', D] drafter context cache; slots < past_len - pending_count are filled
    past_len  [] int64            P, committed tokens
    root      [1] int64           the last emitted token: node 0 of the next tree, at position P
    pending   [B, F]              verifier features of the tokens the last round committed (positions
                                  P - pending_count ..), still to enter the drafter's cache
    pending_count [] int64
    out       [B + 1] int64       out[0] = tokens gained by the last call, out[1:1 + out[0]] the tokens
    S' = capacity + spare slots. A round accepts at most min(N, B) nodes (path_len), the rows of
    pending and out that it uses.
    """

    kv: torch.Tensor
    draft_kv: torch.Tensor | None
    past_len: torch.Tensor
    root: torch.Tensor
    pending: torch.Tensor
    pending_count: torch.Tensor
    out: torch.Tensor


def fast_kernels_default(device: torch.device, compiled: bool) -> bool:
    """The fast kernels are on by default where they run as Triton kernels (CUDA, triton installed),
    unless the steps are compiled: then Inductor does the fusing, over the modules."""
    if device.type != "cuda" or compiled:
        return False
    from treeflash_kernels import layer_ops

    return layer_ops.triton is not None


def build_tree_fast(tables: Tables, root: torch.Tensor, tree_size: int) -> Tree:
    """The tree-build kernel (treeflash_kernels.build_tree) on CUDA where it fits, else the tree
    algebra's build_tree: the same tree either way."""
    from treeflash_kernels import build_tree as bt
    from treeflash_kernels.mlp_expand import runs_triton

    D, _, K = tables.tokens.shape
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
    name = "torch"

    def __init__(self, verifier_hf, drafter=None, *, capacity: int, fused: bool = True,
                 cuda_graphs: bool = True, compile: bool = False, fast_kernels: bool | None = None, log=None):
        """verifier_hf: a Hugging Face causal LM; drafter: a TreeFlashDrafter or None (plain decoding only).
        fused: the TreeFlash head through torch.ops.treeflash.mlp_expand (the Triton kernels on CUDA,
        the PyTorch reference elsewhere) rather than the module composition.
        cuda_graphs: on CUDA, capture prefill passes, rounds and plain steps once each (per tree and
        sampling setting) and replay them; ignored elsewhere. compile: torch.compile the prefill pass,
        the round and the plain step (Inductor fuses the elementwise work between the GEMMs), with its
        cache under the project's cache folder. fast_kernels: kernels that save launches, each with
        a PyTorch reference: the decoder layers through merged projections and the layer kernels
        (models.fused, treeflash_kernels.layer_ops) rather than the Hugging Face modules, the
        expansion's top-k log-probabilities in one read of the logits (treeflash_kernels.topk_logprobs)
        and the tree built in one kernel (treeflash_kernels.build_tree, exactly the reference's tree);
        None = where they run as Triton kernels (CUDA; on CPU the references only add dispatch
        cost) and the steps are not compiled. log: progress lines."""
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
        self.state = self._allocate()
        # Every count a prefill chunk can have, on the device: a chunk's count is a view, never a copy.
        self._chunk_counts = torch.arange(PREFILL_CHUNK + 1, device=self.device)
        self._graphs: dict[tuple, _Captured] = {}
        self._pool = None
        self.generator = torch.Generator(device=self.device)
        self.compiled = bool(compile)
        if self.compiled:
            self._compile_steps()

    # ------------------------------------------------------------------ state

    def _allocate(self) -> DeviceState:
        v, dev = self.verifier, self.device
        slots = self.capacity + max(PREFILL_CHUNK, self.block_size)
        shapes = {"verifier cache": (v.num_layers, 2, v.num_kv_heads, slots, v.head_dim)}
        if self.drafter is not None:
            c = self.drafter.cfg
            shapes["drafter cache"] = (c.num_layers, 2, c.num_kv_heads, slots, c.head_dim)
        caches = allocate_caches(shapes, self.dtype, dev, self.capacity)
        feat = len(v.tap_layer_ids) * v.hidden_size
        zero = torch.zeros((), dtype=torch.long, device=dev)
        return DeviceState(
            kv=caches["verifier cache"], draft_kv=caches.get("drafter cache"), past_len=zero.clone(),
            root=torch.zeros(1, dtype=torch.long, device=dev),
            pending=torch.zeros(self.block_size, feat, dtype=self.dtype, device=dev), pending_count=zero.clone(),
            out=torch.zeros(self.block_size + 1, dtype=torch.long, device=dev),
        )

    def _reset_state(self) -> None:
        """In place: captured graphs hold these tensors' addresses. Cache contents need no clearing:
        nothing reads a slot at or past the committed length without first writing it."""
        st = self.state
        st.past_len.zero_()
        st.root.zero_()
        st.pending_count.zero_()
        st.out.zero_()

    # ------------------------------------------------------------------ the loop's contract

    def _own_drafter_setting(self) -> None:
        """The drafter module is the caller's and may serve several runners: it takes this runner's
        fast-kernel setting at construction and again at each generation (eager rounds and new
        captures read it then; captured graphs keep what they were captured with)."""
        model = self.drafter.model if self.drafter is not None else None
        if model is not None and (model.fused is not None) != self.fast_kernels:
            model.use_layer_kernels(self.fast_kernels)

    @torch.inference_mode()
    def begin(self, prompt: torch.Tensor, tree: TreeConfig, sampling: SamplingConfig) -> int:
        self._own_drafter_setting()
        self.tree, self.sampling = tree, sampling
        self.path_len = 1 if tree.mode == "ar" else min(tree.tree_size, self.block_size)
        if self.use_graphs:
            self._capture_for(tree, sampling)
        self._reset_state()
        self.generator.manual_seed(sampling.seed)
        n = int(prompt.shape[0])
        if self.use_graphs:
            run = self._graphs["prefill", sampling.temperature, sampling.top_p]
            prompt = prompt.to(self.device)  # the generation's one host-to-device copy of its tokens
            for start in range(0, n, PREFILL_CHUNK):
                part = prompt[start : start + PREFILL_CHUNK]
                count = part.shape[0]
                run(torch.nn.functional.pad(part, (0, PREFILL_CHUNK - count)), self._chunk_counts[count])
        else:
            self._prefill(prompt, torch.tensor(n, device=self.device), bound=0 if self.compiled else n)
        self._host_past = n
        return self._emitted()[0]

    @torch.inference_mode()
    def round(self) -> list[int]:
        step = self._ar_step if self.tree.mode == "ar" else self._round
        if self.use_graphs:
            self._graphs[self._graph_key(self.tree, self.sampling)]()
        else:  # eager: the reference attention may stop at a bound the host knows (compiled: one shape)
            step(bound=0 if self.compiled else self._host_past + max(self.tree.tree_size, self.block_size))
        gained = self._emitted()
        self._host_past += len(gained)
        return gained

    def _emitted(self) -> list[int]:
        """The one read-back per call: out[0] tokens from out[1:]."""
        out = self.state.out.tolist()
        return out[1 : 1 + out[0]]

    # ------------------------------------------------------------------ device-resident steps

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        return choose_tokens(logits, self.sampling.temperature, self.sampling.top_p, self.generator)

    def _prefill(self, tokens: torch.Tensor, count: torch.Tensor, bound: int = 0) -> None:
        """tokens [C] (the first ``count`` real, the rest padding) at positions P..; the first new token
        goes to root and out."""
        st = self.state
        C = tokens.shape[0]
        ids = torch.arange(C, device=self.device)
        causal = ids[:, None] >= ids[None, :]
        last = (count - 1).reshape(1)
        logits, feats = self.verifier.forward_cached(tokens, st.past_len + ids, causal, st.kv, st.past_len,
                                                     key_bound=bound, logit_rows=last)
        if self.drafter is not None:
            self.drafter.model.forward_cached(feats, st.past_len, count, None, st.draft_kv, key_bound=bound)
        st.past_len += count
        first = self.pick(logits)
        st.root.copy_(first)
        st.out[:1].fill_(1)  # not out[0] = 1: a Python number is copied from the host, a sync
        st.out[1:2].copy_(first)

    def _ar_step(self, bound: int = 0) -> None:
        """Plain decoding: one token through the verifier."""
        st = self.state
        with self._stage("verify"):
            one = torch.ones(1, 1, dtype=torch.bool, device=self.device)
            logits, _ = self.verifier.forward_cached(st.root, st.past_len.reshape(1), one, st.kv, st.past_len,
                                                     key_bound=bound)
            token = self.pick(logits)
        st.past_len += 1
        st.root.copy_(token)
        st.out[:1].fill_(1)
        st.out[1:2].copy_(token)

    def _round(self, bound: int = 0) -> None:
        """draft -> expand -> build tree -> verify -> accept -> commit, all on the device."""
        st, tree_cfg = self.state, self.tree
        with self._stage("draft"):
            z = self.draft(bound)
        with self._stage("expand"):
            tables = self.tables(st.root, z, tree_cfg)
        with self._stage("tree"):
            tree = self.build_tree(tables, st.root, tree_cfg.tree_size)
        with self._stage("verify"):
            logits, feats = self.verifier.forward_cached(tree.tokens, st.past_len + tree.depths, tree.mask, st.kv,
                                                         st.past_len, key_bound=bound)
            y = self.pick(logits)
        with self._stage("accept"):
            self.commit(tree, y, feats)

    def draft(self, bound: int = 0) -> torch.Tensor:
        """Stage 1: the pending context enters the drafter's cache, then the block [root, MASK x (B-1)]
        at positions P..P+B-1 -> z [B, H] (pre-norm)."""
        st, B = self.state, self.block_size
        block = torch.full((B,), self.mask_token_id, dtype=torch.long, device=self.device)
        block = torch.cat([st.root, block[1:]])
        ctx = st.pending[: self.path_len]
        return self.drafter.model.forward_cached(ctx, st.past_len - st.pending_count, st.pending_count,
                                                 self.verifier.embed_tokens(block), st.draft_kv, key_bound=bound)

    def tables(self, root: torch.Tensor, z: torch.Tensor, tree: TreeConfig) -> Tables:
        """Stage 2: transition tables for the mode (see treeflash_export.models.expand)."""
        norm = self.drafter.model.norm
        logits = self.verifier.lm_head(norm(z))
        if tree.mode == "treeflash":
            return treeflash_tables(
                z, logits, root, head=self.drafter.ar_approximation, norm=norm,
                embed_tokens=self.verifier.embed_tokens, lm_head=self.verifier.lm_head,
                top_m=tree.top_m, top_k=tree.top_k, temperature=tree.drafter_temperature, fused=self.fused,
                topk_kernel=self.fast_kernels,
            )
        return marginal_tables(logits, tree.top_k, tree.drafter_temperature, topk_kernel=self.fast_kernels)

    def commit(self, tree: Tree, y: torch.Tensor, feats: torch.Tensor) -> None:
        """Accept the deepest matching path (tau nodes) and commit it, in fixed shapes: its K/V move to
        slots P..P+tau-1 (no RoPE fix-up: a node at depth d already sits at position P + d), its
        features become the drafter's pending context, its drafts and the bonus go to out."""
        st, L = self.state, self.path_len
        path, tau, bonus = accept(tree, y, L)
        slots = st.past_len + torch.arange(L, device=self.device)
        # Gather first (a copy), then write: source and destination slots may overlap.
        st.kv.index_copy_(3, slots, st.kv.index_select(3, st.past_len + path))
        st.pending[:L].copy_(feats[path])
        st.pending_count.copy_(tau)
        drafts = tree.tokens[path[1:]]  # path order; only the first tau - 1 are accepted drafts
        gained = torch.cat([drafts, bonus.reshape(1)])
        gained = torch.where(torch.arange(L, device=self.device) == tau - 1, bonus, gained)
        st.out[:1].copy_(tau.reshape(1))
        st.out[1 : 1 + L].copy_(gained)
        st.past_len += tau
        st.root.copy_(bonus.reshape(1))

    # ------------------------------------------------------------------ compilation, CUDA graphs, timing

    def _compile_steps(self) -> None:
        """Wraps the three step functions from outside (the model code stays eager and readable).
        Shapes are static per tree setting, so each setting compiles once; Inductor's cache lives
        under the project's cache folder (TREEFLASH_CACHE), so a second start reuses it."""
        _project_cache("TORCHINDUCTOR_CACHE_DIR", "inductor")
        for name in ("_prefill", "_round", "_ar_step"):
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
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        yield
        sync()
        self.timer[name] = self.timer.get(name, 0.0) + time.perf_counter() - t0

    def graph_stage_times(self, count: int) -> dict[str, float]:
        """Milliseconds per stage of the current setting's round as it runs in a CUDA graph: a
        separate capture with timing events between the stages, replayed ``count`` times from the
        current state (restored before each replay, so the committed length stays where it is)."""
        st = self.state
        saved = [t.clone() for t in (st.past_len, st.root, st.pending, st.pending_count)]

        def restore():
            for dst, src in zip((st.past_len, st.root, st.pending, st.pending_count), saved):
                dst.copy_(src)

        self._marks = []
        try:
            step = self._ar_step if self.tree.mode == "ar" else self._round
            graph = self._capture(step, (), restore)
            totals = dict.fromkeys((name for name, _, _ in self._marks), 0.0)
            for _ in range(count):
                restore()
                graph()
                torch.cuda.synchronize(self.device)
                for name, start, end in self._marks:
                    totals[name] += start.elapsed_time(end)
        finally:
            self._marks = None
            restore()
        return {name: ms / count for name, ms in totals.items()}

    def _capture(self, fn, args, reset) -> _Captured:
        """fn(*args) as a replayable graph in this runner's memory pool. (The CPU tests put an eager
        stand-in here, so that the functions and arguments CUDA captures run, and are checked, on CPU.)"""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return _Captured(fn, args, self._pool, self.generator, reset)

    @staticmethod
    def _graph_key(tree: TreeConfig, sampling: SamplingConfig) -> tuple:
        return (tree, sampling.temperature, sampling.top_p)

    def _capture_for(self, tree: TreeConfig, sampling: SamplingConfig) -> None:
        """Captures, once per runner, the prefill pass and the step for this tree and sampling setting.
        Warm-up and capture run real steps on scratch state, which begin() then resets."""
        key = self._graph_key(tree, sampling)
        todo = [k for k in (("prefill", *key[1:]), key) if k not in self._graphs]
        if not todo:
            return
        t0 = time.perf_counter()
        dev = self.device

        def scratch_round():
            self._reset_state()
            self.state.past_len.fill_(1)  # a round needs a root and a committed position

        for k in todo:
            if k[0] == "prefill":
                args = (torch.zeros(PREFILL_CHUNK, dtype=torch.long, device=dev),
                        torch.tensor(PREFILL_CHUNK, device=dev))
                self._graphs[k] = self._capture(self._prefill, args, self._reset_state)
            else:
                step = self._ar_step if tree.mode == "ar" else self._round
                self._graphs[k] = self._capture(step, (), scratch_round)
        what = "plain decoding" if tree.mode == "ar" else f"{tree.mode} N={tree.tree_size}"
        self.log(f"captured CUDA graphs ({', '.join('prefill' if k[0] == 'prefill' else what for k in todo)}) "
                 f"in {time.perf_counter() - t0:.1f}s")


class _Captured:
    """fn(*args) captured once in a CUDA graph with static copies of its tensor arguments;
    calling copies the new arguments in and replays. fn's effects are its writes to state."""

    def __init__(self, fn, args, pool, generator: torch.Generator, reset, warmup: int = 2):
        """reset() puts the scratch state back before each warm-up run and before the capture, so
        the passes never move the committed length past the cache (a prefill pass adds a chunk)."""
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
        self.graph.register_generator_state(generator)  # sampling draws advance on every replay
        with torch.cuda.graph(self.graph, pool=pool):
            fn(*self.args)

    def __call__(self, *args) -> None:
        for dst, src in zip(self.args, args):
            dst.copy_(src)
        self.graph.replay()
