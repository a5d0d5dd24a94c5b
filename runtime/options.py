"""The model options treeflash-run and treeflash-serve share (which pair, tree, cache, device), their
checks, and the session they load: one definition, so the two commands cannot drift apart."""

from __future__ import annotations

import click

from treeflash_export.config import MODES, TreeConfig
from treeflash_export.errors import TreeFlashError

_TREE = TreeConfig()
ON_OFF = {"auto": None, "on": True, "off": False}  # --fast-kernels
TUNED = ("mode", "tree_size", "top_m", "top_k")  # the tree settings the self-tuning tree may choose


class AutoOrInt(click.ParamType):
    """'auto' (the self-tuning tree chooses) or a whole number."""

    name = "auto|N"

    def convert(self, value, param, ctx):
        if value is None or isinstance(value, int) or str(value).strip().lower() == "auto":
            return "auto" if isinstance(value, str) else value
        try:
            return int(value)
        except ValueError:
            self.fail(f"{value!r} is neither auto nor a whole number", param, ctx)


_AUTO_HELP = " auto: the self-tuning tree chooses, round by round (torch backend over checkpoints; see docs/tuning.md)."
_DEFAULT = "[default: auto over checkpoints; an artifact's own setting]"

_OPTIONS = [
    click.option("--model", "model", default=None, help="Verifier: a local Hugging Face folder or a hub id. "
                 "[default: SmolLM2-135M-Instruct with the demo TreeFlash drafter, offline]"),
    click.option("--drafter", default=None, help="TreeFlash or DFlash drafter: a local folder or a hub id "
                 "(not needed with --mode ar). Without --model it drafts for SmolLM2-135M-Instruct, e.g. one "
                 "trained by `treeflash-export train`."),
    click.option("--artifacts", "artifacts", default=None, type=click.Path(file_okay=False),
                 help="An artifact folder from `treeflash-export build` (instead of --model/--drafter); "
                      "tree settings and cache size come from its manifest."),
    click.option("--verify-checksums/--no-verify-checksums", default=True,
                 help="Check every artifact file against the manifest's SHA-256 before use."),
    click.option("--mode", type=click.Choice(MODES + ("auto",)), default=None,
                 help=f"treeflash: head-conditioned tree; marginal: DDTree-style tree; chain: DFlash path; "
                      f"ar: plain decoding on the same backend (the baseline).{_AUTO_HELP} {_DEFAULT}"),
    click.option("--tree-size", type=AutoOrInt(), default=None,
                 help=f"Tree nodes per round N, root included.{_AUTO_HELP} {_DEFAULT}"),
    click.option("--top-m", type=AutoOrInt(), default=None,
                 help=f"Candidate parents per position (treeflash).{_AUTO_HELP} {_DEFAULT}"),
    click.option("--top-k", type=AutoOrInt(), default=None,
                 help=f"Children per parent row.{_AUTO_HELP} {_DEFAULT}"),
    click.option("--retune", is_flag=True,
                 help="With auto tree settings: time each candidate's round again and forget what earlier runs "
                      "measured (kept under TREEFLASH_CACHE/tuner)."),
    click.option("--draft-vocab", type=AutoOrInt(), default="auto", show_default=True,
                 help="torch backend: how many tokens the drafter ranks, most frequent in its training data first "
                      "(the drafter folder's draft-vocab.json, written by `treeflash-export train`): fewer LM-head rows "
                      "make each round cheaper; the output is the verifier's either way. auto: the whole list (the "
                      "whole vocabulary without one); 0: the whole vocabulary; N: the first N."),
    click.option("--drafter-temperature", type=float, default=None,
                 help=f"Temperature of the drafter scores that shape the tree (never changes the output). "
                      f"[default: {_TREE.drafter_temperature}, or the artifact's]"),
    click.option("--max-seq-len", type=int, default=None,
                 help="KV cache capacity S (prompt + new tokens - 1 + tree nodes must fit). [default: 2048, or "
                      "the artifact's]"),
    click.option("--device", default="auto", help="auto, cpu, cuda or cuda:N."),
    click.option("--dtype", type=click.Choice(["auto", "float32", "float16", "bfloat16"]), default="auto",
                 help="auto = float32 on CPU, bfloat16 on CUDA."),
    click.option("--cuda-graphs/--no-cuda-graphs", default=True,
                 help="torch backend on CUDA: capture the prefill pass, the round and the plain step as CUDA "
                      "graphs (once per loaded model and setting) and replay them; off runs the same round "
                      "eagerly."),
    click.option("--fast-kernels", type=click.Choice(["auto", "on", "off"]), default="auto",
                 help="torch backend: the project's launch-saving kernels (Triton on CUDA; their PyTorch "
                      "references elsewhere): the decoder layers through merged q/k/v and gate/up projections and "
                      "fused norm, RoPE and SwiGLU kernels, the expansion's top-k log-probabilities in one read of "
                      "the logits, and the tree built in one kernel; off runs the Hugging Face modules and "
                      "PyTorch operations. auto = on on CUDA without --compile, else off."),
]


def model_options(command):
    """Adds the shared model options to a click command (its function takes them as keywords)."""
    for option in reversed(_OPTIONS):
        command = option(command)
    return command


def check_model_options(model, drafter, artifacts, mode, max_seq_len) -> None:
    """The checks that need no model loaded (one-line errors before anything is read)."""
    if artifacts is None:
        if model and (mode or _TREE.mode) not in ("ar", "auto") and not drafter:
            raise TreeFlashError(f"--drafter is required for --mode {mode or _TREE.mode} "
                                 f"(or use --mode ar for plain decoding)")
    elif model or drafter:
        raise TreeFlashError("--artifacts replaces --model and --drafter: pass one or the other")
    if max_seq_len is not None and max_seq_len < 2:
        raise TreeFlashError(f"--max-seq-len {max_seq_len} is too small")


def load_session(*, model, drafter, artifacts, verify_checksums, mode, tree_size, top_m, top_k, drafter_temperature,
                 max_seq_len, device, dtype, cuda_graphs, fast_kernels, backend="torch", compile_steps=False,
                 log=None, retune=False, draft_vocab="auto", **batch):
    """The session these options name: checkpoints (the default pair without --model) or an artifact
    folder. batch: max_batch (and tree_size_by_batch) for request slots on the torch backend. Tree
    settings given as 'auto' are chosen round by round by the self-tuning tree (``Session.tuner``):
    on the torch backend over checkpoints, one sequence at a time."""
    from .factory import DEFAULT_CAPACITY, build_tuner, session_from_artifacts, session_from_checkpoints

    requested = dict(mode=mode, tree_size=tree_size, top_m=top_m, top_k=top_k,
                     drafter_temperature=drafter_temperature)
    table = batch.get("tree_size_by_batch")
    if artifacts is None and backend == "torch" and not table:
        # Over checkpoints on the torch backend a tree setting left out is the self-tuning tree's to choose.
        requested.update({k: "auto" for k in TUNED if requested[k] is None})
    auto = [k for k in TUNED if requested[k] == "auto"]
    if auto:
        where = ("an artifact keeps its manifest's tree settings" if artifacts is not None else
                 "only the torch backend tunes its tree" if backend != "torch" else
                 "--tree-size-by-batch is an explicit tree (give every tree setting, or leave the table out)"
                 if table else "")
        if where:
            raise TreeFlashError(f"--{auto[0].replace('_', '-')} auto: {where}; give a value")
    kernels = ON_OFF[fast_kernels] if isinstance(fast_kernels, str) else fast_kernels
    if artifacts is None:
        given = {k: v for k, v in requested.items() if v is not None and v != "auto"}
        tree = TreeConfig(**given)
        if "mode" not in auto and tree.mode in ("ar", "chain"):
            auto = []  # nothing left to choose: plain decoding and the chain have no tree settings
        sess = session_from_checkpoints(model or None, drafter, tree, max_seq_len or DEFAULT_CAPACITY, backend,
                                        device, dtype, log=log, cuda_graphs=cuda_graphs, compile_steps=compile_steps,
                                        fast_kernels=kernels, mode_auto="mode" in auto,
                                        draft_vocab=None if draft_vocab == "auto" else draft_vocab,
                                        capture_at_start=not auto, **batch)
        if auto:
            sess.tuner = build_tuner(sess, {k: v for k, v in given.items() if k in TUNED}, retune=retune, log=log)
        return sess
    return session_from_artifacts(artifacts, requested, max_seq_len=max_seq_len, backend=backend, device=device,
                                  dtype=dtype, verify_checksums=verify_checksums, cuda_graphs=cuda_graphs,
                                  compile_steps=compile_steps, fast_kernels=kernels, log=log, **batch)
