"""One round code: a single sequence is the one-slot case of the slot runner. Keyed sampling gives a
seed the same tokens on every path; the costs a GPU would feel (vocabulary-sized temporaries,
copies of whole slot caches, graphs per sampling value) are checked here on the CPU."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from treeflash_export.config import SamplingConfig, TreeConfig
from treeflash_runtime import generate
from treeflash_runtime.backends.pytorch import TorchRunner
from treeflash_runtime.sampling import GREEDY, NUCLEUS, ROW_CHUNK_ELEMENTS, SAMPLE, choose_tokens_keyed

TREE = dict(tree_size=12, top_m=3, top_k=3)


class TensorBytes(TorchDispatchMode):
    """Every tensor the operators make: the peak of their live bytes (freed ones drop out), the
    largest one, the largest source an in-place operator copies from (what it writes), and the
    operators called."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = self.largest = self.written = 0
        self.ops: set[str] = set()
        self.int64_numel = 0
        self.storages: set[int] = set()  # storages seen so far (a view shares its base's)

    def _freed(self, ptr, nbytes):
        self.live -= nbytes
        self.storages.discard(ptr)


    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        self.ops.add(name)
        if name.endswith("_"):
            sources = [t for t in tree_leaves((args[1:], kwargs or {})) if isinstance(t, torch.Tensor)]
            self.written = max([self.written] + [t.numel() * t.element_size() for t in sources])
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs or {}))
                  if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            ptr = t.untyped_storage().data_ptr()
            if ptr in inputs or ptr in self.storages:
                continue  # a view, or an operator that wrote into its argument
            nbytes = t.untyped_storage().nbytes()
            self.storages.add(ptr)
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            self.largest = max(self.largest, nbytes)
            if t.dtype == torch.int64:
                self.int64_numel = max(self.int64_numel, t.numel())
            weakref.finalize(t, self._freed, ptr, nbytes)
        return out


def test_keyed_sampling_at_real_vocabulary_size_keeps_its_temporaries_bounded():
    """Eight slots x 64 nodes over Qwen3's 151,936-token vocabulary: no [slots, N, V] int64 hash (the old
    form made ten of 311 MB each here), float32 temporaries in chunks of rows, and the nucleus sort
    only when some request asks for top-p < 1."""
    k, n, V = 8, 64, 151_936
    logits = torch.randn(k, n, V, generator=torch.Generator().manual_seed(0))
    temperature = torch.tensor([0.0, 1.0, 0.7, 1.0, 1.3, 0.0, 1.0, 0.5])
    seed, positions = torch.arange(k), torch.arange(n).expand(k, n) + 100
    chunk_bytes = 4 * (ROW_CHUNK_ELEMENTS // V) * V
    for kind, top_p in ((SAMPLE, torch.ones(k)), (NUCLEUS, torch.full((k,), 0.9))):
        with TensorBytes() as spy:
            out = choose_tokens_keyed(logits, temperature, top_p, seed, positions, kind)
        assert out.shape == (k, n) and bool(((out >= 0) & (out < V)).all())
        assert spy.int64_numel <= k * n or (kind == NUCLEUS and spy.int64_numel <= 2 * chunk_bytes // 4), kind
        assert ("sort" in spy.ops) == (kind == NUCLEUS), spy.ops
        # The nucleus sorts (values and int64 order) in the same chunks; the whole peak stays below one
        # of the old form's int64 temporaries.
        bound = 4 * chunk_bytes if kind == SAMPLE else 8 * chunk_bytes
        assert spy.largest <= 2 * chunk_bytes and spy.peak <= bound < k * n * V * 8, (kind, spy.largest, spy.peak)
        print(f"kind {kind}: peak {spy.peak / 2**20:.0f} MiB of temporaries for {logits.numel() * 4 / 2**20:.0f} "
              f"MiB of logits; largest {spy.largest / 2**20:.0f} MiB")
    assert torch.equal(out[temperature == 0], logits[temperature == 0].argmax(-1))


def test_sampling_kinds_agree_where_they_overlap():
    """A request's tokens do not depend on what others in its round need: with top-p 1 the nucleus
    path gives the plain sampler's tokens, and greedy rows are the argmax in every kind."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 5, 50, generator=g)
    t, p, seed = torch.tensor([1.0, 0.0, 0.8]), torch.ones(3), torch.tensor([4, 5, 6])
    pos = torch.arange(5).expand(3, 5)
    plain = choose_tokens_keyed(logits, t, p, seed, pos, SAMPLE)
    assert torch.equal(plain, choose_tokens_keyed(logits, t, p, seed, pos, NUCLEUS))
    assert torch.equal(plain[1], choose_tokens_keyed(logits, t, p, seed, pos, GREEDY)[1])


def _single(pair, mode, sampling, runner=None):
    runner = runner or TorchRunner(pair.verifier, pair.drafter, capacity=96)
    tree = TreeConfig(mode=mode, **TREE) if mode != "ar" else TreeConfig(mode="ar")
    return generate(runner, PROMPT_IDS, tree, sampling).token_ids


PROMPT_IDS = [3, 17, 5, 9, 22, 4]


def test_a_seed_gives_the_same_tokens_on_every_path(load):
    """Plain decoding, every tree mode (one sequence), and the batching engine with other requests in
    the same rounds: the same seed, the same tokens (keyed sampling; one round code)."""
    from treeflash_runtime.engine import Engine, Request

    pair = load("qwen3")
    runner = TorchRunner(pair.verifier, pair.drafter, capacity=96)
    settings = [SamplingConfig(temperature=1.0, max_new_tokens=16, seed=7, stop_token_ids=()),
                SamplingConfig(temperature=0.8, top_p=0.9, max_new_tokens=16, seed=8, stop_token_ids=()),
                SamplingConfig(max_new_tokens=16, stop_token_ids=())]
    alone = [_single(pair, "ar", s, runner) for s in settings]
    assert len(set(map(tuple, alone))) == 3
    for mode in ("treeflash", "marginal", "chain"):
        assert [_single(pair, mode, s, runner) for s in settings] == alone, mode
    batched = TorchRunner(pair.verifier, pair.drafter, capacity=96, max_batch=3, tree=TreeConfig(**TREE))
    requests = [Request(list(PROMPT_IDS), s) for s in settings]
    Engine(batched).run(requests)
    assert [r.tokens for r in requests] == alone


def test_graph_keys_hold_the_sampling_kind_not_its_values(load):
    """Distinct temperatures and top-p values reuse the graphs of their kind (device data, not keys)."""
    from test_device_round import captured_form

    pair = load("qwen3")
    runner = TorchRunner(pair.verifier, pair.drafter, capacity=384)
    captured_form(runner)
    for t, p in ((0.7, 0.9), (1.3, 0.5), (0.9, 0.95), (1.0, 1.0), (0.5, 1.0), (0.0, 1.0), (0.0, 0.3)):
        _single(pair, "treeflash", SamplingConfig(temperature=t, top_p=p, max_new_tokens=6, seed=1), runner)
    kinds = sorted(key[3] for key in runner.graphs if key[0] == "round")
    assert kinds == [GREEDY, SAMPLE, NUCLEUS] and len(runner.graphs) == 4  # + one prefill graph


def _largest_made(fn) -> tuple[int, int]:
    """(largest tensor made, largest in-place write) while fn runs."""
    with TensorBytes() as spy:
        fn()
    return spy.largest, spy.written


@pytest.mark.parametrize("fast_kernels", [False, True], ids=["torch-ops", "layer-kernels"])
def test_prefill_and_release_cost_does_not_grow_with_the_cache(load, fast_kernels):
    """A short request's prefill (attention over its slot's range, read in place) and release (moving
    only the committed part of the last slot) make the same tensors whether a slot holds 128 or 2,048
    tokens; the moved slot keeps its tokens and the copy stops at its length."""
    pair = load("qwen3")
    largest = {}
    for capacity in (128, 2048):
        runner = TorchRunner(pair.verifier, pair.drafter, capacity=capacity, max_batch=3, tree=TreeConfig(**TREE),
                             fast_kernels=fast_kernels)
        for slot in range(3):
            runner.admit(slot, SamplingConfig())
        prompt = torch.tensor(PROMPT_IDS)
        prefill = _largest_made(lambda: runner.prefill_many([(1, prompt, True), (2, prompt[:4], True)]))
        runner.state.kv[:, :, :, 2 * runner.slot_size + 20 :] = float("nan")  # slot 2's unused part
        release = _largest_made(lambda: runner.release(0))
        largest[capacity] = (prefill, release)
        kv = runner.state.kv
        assert not bool(kv[:, :, :, 4 : runner.slot_size].isnan().any())  # only the committed part moved
        assert bool(kv[:, :, :, :4].isfinite().all()) and runner.slots.host_len[:2] == [4, 6]
    assert largest[128] == largest[2048], largest
