"""Building a ready-to-generate session (runner, tokenizer, tree settings, stop ids) from
checkpoints or from an artifact folder; shared by treeflash-run and treeflash-bench."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from treeflash_export.checkpoints import pick_device
from treeflash_export.config import TreeConfig
from treeflash_export.errors import TreeFlashError

from .backends.base import Runner

DEFAULT_CAPACITY = 2048


@dataclass
class Session:
    runner: Runner
    tokenizer: Any
    tree: TreeConfig
    stop_token_ids: tuple[int, ...]
    dtype: str
    load_stages_s: dict[str, float] = field(default_factory=dict)  # seconds per loading step, where known
    sources: tuple[str, ...] = ()  # the checkpoint folders the pair was read from (what tuned costs depend on)
    tuner: Any = None  # the self-tuning tree (treeflash_runtime.tuner.online.TreeTuner) when settings are auto


def default_pair(log=None) -> tuple[str, str]:
    """The out-of-the-box pair: SmolLM2-135M-Instruct and the demo drafter shipped with the package."""
    from treeflash_export.smollm import DEMO_DRAFTER, default_verifier

    if not (DEMO_DRAFTER / "model.safetensors").is_file():
        raise TreeFlashError("the demo drafter is missing from this installation: pass --model and --drafter")
    return str(default_verifier(log=log)), str(DEMO_DRAFTER)


def session_from_checkpoints(model: str | None, drafter: str | None, tree: TreeConfig, capacity: int,
                             backend: str = "torch", device: str = "auto", dtype: str = "auto",
                             log=None, cuda_graphs: bool = True, compile_steps: bool = False,
                             fast_kernels: bool | None = None, max_batch: int = 0,
                             tree_size_by_batch: dict[int, int] | None = None, mode_auto: bool = False,
                             draft_vocab: int | None = None, capture_at_start: bool = True) -> Session:
    """model None: SmolLM2-135M-Instruct (converted on first use, progress through ``log``, which
    also reports CUDA graph captures) with ``drafter``, or with the demo drafter when that is None
    too. mode_auto: the self-tuning tree picks the mode, so a drafter without a head (DFlash) gets
    the marginal tree as its deployment tree instead of an error. draft_vocab: how many tokens the
    drafter ranks (None: its draft-vocab.json, else all; 0: all; see TorchRunner). capture_at_start:
    with request slots and CUDA graphs, capture the deployment tree's rounds at start-up (False
    where the self-tuning tree will plan every round: it runs other graphs)."""
    from treeflash_export.checkpoints import eos_token_ids, load_pair, parse_dtype

    from .backends import get_runner_class

    if backend != "torch":
        raise TreeFlashError(f"--backend {backend} runs an artifact folder: pass --artifacts DIR "
                             f"(build one with treeflash-export build)")
    if model is None:
        model, demo = default_pair(log=log)
        drafter = drafter or demo  # a drafter of one's own for the default verifier is kept
    dev = pick_device(device)
    torch_dtype = parse_dtype(dtype, dev)

    def check(vcfg, dcfg):
        nonlocal tree
        if mode_auto and dcfg is not None and not dcfg.has_head and tree.mode == "treeflash":
            tree = dataclasses.replace(tree, mode="marginal", top_m=1)
        if dcfg is not None and tree.mode != "ar":
            tree.validate(block_size=dcfg.block_size, vocab_size=dcfg.vocab_size, has_head=dcfg.has_head)

    pair = load_pair(model, drafter if tree.mode != "ar" else None, dtype=torch_dtype, device=dev, check=check,
                     log=log)
    t0 = time.perf_counter()
    if max_batch:  # request slots served together (in-flight batching), with the deployment's tree
        from .backends.pytorch import TorchRunner

        runner = TorchRunner(pair.verifier, pair.drafter, max_batch=max_batch, capacity=capacity, tree=tree,
                             tree_size_by_batch=tree_size_by_batch, cuda_graphs=cuda_graphs,
                             compile=compile_steps, fast_kernels=fast_kernels, draft_vocab=draft_vocab, log=log,
                             capture_at_start=capture_at_start)
    else:
        runner = get_runner_class(backend)(pair.verifier, pair.drafter, capacity=capacity, cuda_graphs=cuda_graphs,
                                           compile=compile_steps, fast_kernels=fast_kernels, draft_vocab=draft_vocab,
                                           log=log)
    stages = {**pair.seconds, "runner": time.perf_counter() - t0}  # runner: caches allocated
    return Session(runner, pair.tokenizer, tree, tuple(eos_token_ids(pair.tokenizer, pair.verifier)),
                   str(torch_dtype).replace("torch.", ""), stages,
                   sources=tuple(str(p) for p in (model, drafter if tree.mode != "ar" else None) if p))


def build_tuner(sess: Session, fixed: dict | None = None, *, retune: bool = False, log=None):
    """The self-tuning tree for a session's runner (the one place it is built): it chooses the tree
    settings left out of ``fixed`` (field -> value), with the session's pair and dtype naming its
    caches and its drafter temperature shaping the trees."""
    from .tuner.online import TreeTuner

    return TreeTuner.for_runner(sess.runner, fixed or {}, sources=sess.sources, dtype=sess.dtype, retune=retune,
                                log=log, drafter_temperature=sess.tree.drafter_temperature)


def session_from_artifacts(folder: str, requested: dict, *, max_seq_len: int | None = None,
                           backend: str = "onnxruntime", device: str = "auto", dtype: str = "auto",
                           verify_checksums: bool = True, cuda_graphs: bool = True,
                           compile_steps: bool = False, fast_kernels: bool | None = None, log=None,
                           max_batch: int = 0, tree_size_by_batch: dict[int, int] | None = None,
                           tune: bool = False) -> Session:
    """requested: tree settings given by the user (None = take the artifact's); mode 'ar' is
    plain decoding over the artifact's verify graph. tune (torch backend): the self-tuning tree
    chooses each round's tree within the artifact's (Session.tuner)."""
    from treeflash_export.export.artifact import check_tree_request, load_artifact
    from treeflash_export.checkpoints import load_tokenizer

    from .backends import get_runner_class

    t0 = time.perf_counter()
    art = load_artifact(folder, verify_checksums=verify_checksums)
    stages = {"artifact": time.perf_counter() - t0}  # manifest read, checksums verified
    wants_ar = requested.get("mode") == "ar"
    check_tree_request(art, {k: v for k, v in requested.items() if not (wants_ar and k == "mode")})
    tree = TreeConfig(mode="ar") if wants_ar else art.tree
    if max_seq_len is not None and max_seq_len != art.shapes.capacity:
        raise TreeFlashError(f"artifact was built with --max-seq-len {art.shapes.capacity}, not {max_seq_len}: "
                             f"omit the option or rebuild")
    if dtype not in ("auto", art.dtype):
        raise TreeFlashError(f"artifact was built in {art.dtype}, not {dtype}: omit --dtype or rebuild")
    tok = load_tokenizer(art.root / "tokenizer")
    if backend == "torch":  # the eager model over the source checkpoints, with the artifact's settings
        src = art.manifest["sources"]
        sess = session_from_checkpoints(src["verifier"], src["drafter"], tree, art.shapes.capacity, "torch",
                                        device, art.dtype, log=log, cuda_graphs=cuda_graphs,
                                        compile_steps=compile_steps, fast_kernels=fast_kernels,
                                        max_batch=max_batch, tree_size_by_batch=tree_size_by_batch)
        out = Session(sess.runner, tok, tree, art.stop_token_ids, art.dtype, {**stages, **sess.load_stages_s},
                      sources=sess.sources)
        if tune and tree.mode != "ar":
            out.tuner = build_tuner(out, log=log)
        return out
    cls = get_runner_class(backend)
    t0 = time.perf_counter()
    runner = cls(art) if backend == "onnxruntime" else cls(art, device="cuda" if device == "auto" else device)
    stages["runner"] = time.perf_counter() - t0  # graphs or engines loaded
    if log is not None:
        log(f"loaded the {backend} runner in {stages['runner']:.1f}s")
    return Session(runner, tok, tree, art.stop_token_ids, art.dtype, stages)
