"""`treeflash-run`: generate text with tree speculative decoding (or plain decoding as the baseline)."""

from __future__ import annotations

import dataclasses
import json
import sys
import time

import click

from treeflash_export.config import MODES, SamplingConfig, TreeConfig
from treeflash_export.errors import TreeFlashError

_TREE = TreeConfig()
_SAMPLING = SamplingConfig()
_ON_OFF = {"auto": None, "on": True, "off": False}  # --fast-kernels


class _Streamer:
    """Prints decoded text as tokens arrive, holding back incomplete UTF-8 sequences."""

    def __init__(self, tokenizer, stream):
        from .serving.service import IncrementalText

        self.text, self.stream = IncrementalText(tokenizer), stream

    def __call__(self, new: list[int]) -> None:
        piece = self.text.add(new)
        if piece:
            self.stream.write(piece)
            self.stream.flush()


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--model", "model", default=None, help="Verifier: a local Hugging Face folder or a hub id. "
              "[default: SmolLM2-135M-Instruct with the demo TreeFlash drafter, offline]")
@click.option("--drafter", default=None, help="TreeFlash or DFlash drafter: a local folder or a hub id "
              "(not needed with --mode ar). Without --model it drafts for SmolLM2-135M-Instruct, e.g. one "
              "trained by `treeflash-export train`.")
@click.option("--artifacts", "artifacts", default=None, type=click.Path(file_okay=False),
              help="An artifact folder from `treeflash-export build` (instead of --model/--drafter); "
                   "tree settings and cache size come from its manifest.")
@click.option("--verify-checksums/--no-verify-checksums", default=True,
              help="Check every artifact file against the manifest's SHA-256 before use.")
@click.option("--prompt", default=None, help="Prompt text; read from standard input when omitted.")
@click.option("--chat/--no-chat", default=False, help="Wrap the prompt in the tokenizer's chat template.")
@click.option("--mode", type=click.Choice(MODES), default=None,
              help=f"treeflash: head-conditioned tree; marginal: DDTree-style tree; chain: DFlash path; "
                   f"ar: plain decoding on the same backend (the baseline). [default: {_TREE.mode}, or the "
                   f"artifact's]")
@click.option("--tree-size", type=int, default=None,
              help=f"Tree nodes per round N, root included. [default: {_TREE.tree_size}, or the artifact's]")
@click.option("--top-m", type=int, default=None,
              help=f"Candidate parents per position (treeflash). [default: {_TREE.top_m}, or the artifact's]")
@click.option("--top-k", type=int, default=None,
              help=f"Children per parent row. [default: {_TREE.top_k}, or the artifact's]")
@click.option("--drafter-temperature", type=float, default=None,
              help=f"Temperature of the drafter scores that shape the tree (never changes the output). "
                   f"[default: {_TREE.drafter_temperature}, or the artifact's]")
@click.option("--temperature", type=float, default=_SAMPLING.temperature, help="Verifier temperature; 0 = greedy.")
@click.option("--top-p", type=float, default=_SAMPLING.top_p, help="Verifier nucleus sampling mass.")
@click.option("--max-new-tokens", type=int, default=_SAMPLING.max_new_tokens)
@click.option("--seed", type=int, default=_SAMPLING.seed, help="Seed of the verifier's sampling.")
@click.option("--stop-token-id", "stop_token_ids", type=int, multiple=True,
              help="Extra token id that ends generation (repeatable); EOS ids are added unless --ignore-eos.")
@click.option("--ignore-eos", is_flag=True, help="Do not stop at the default stop set: the tokenizer's and generation config's EOS ids and the chat template's end-of-turn token.")
@click.option("--max-seq-len", type=int, default=None,
              help="KV cache capacity S (prompt + new tokens - 1 + tree nodes must fit). [default: 2048, or the "
                   "artifact's]")
@click.option("--backend", type=click.Choice(["torch", "onnxruntime", "tensorrt"]), default="torch",
              help="Runtime backend; onnxruntime and tensorrt run an artifact folder.")
@click.option("--device", default="auto", help="auto, cpu, cuda or cuda:N.")
@click.option("--dtype", type=click.Choice(["auto", "float32", "float16", "bfloat16"]), default="auto",
              help="auto = float32 on CPU, bfloat16 on CUDA.")
@click.option("--cuda-graphs/--no-cuda-graphs", default=True,
              help="torch backend on CUDA: capture the prefill pass, the round and the plain step as CUDA graphs "
                   "(once per loaded model and setting) and replay them; off runs the same round eagerly.")
@click.option("--compile/--no-compile", "compile_steps", default=False,
              help="torch backend: torch.compile the prefill pass, the round and the plain step (Inductor fuses "
                   "the elementwise work; minutes the first time, cached under TREEFLASH_CACHE after).")
@click.option("--fast-kernels", type=click.Choice(["auto", "on", "off"]), default="auto",
              help="torch backend: the project's launch-saving kernels (Triton on CUDA; their PyTorch references "
                   "elsewhere): the decoder layers through merged q/k/v and gate/up projections and fused norm, "
                   "RoPE and SwiGLU kernels, the expansion's top-k log-probabilities in one read of the logits, and "
                   "the tree built in one kernel; off runs the Hugging Face modules and PyTorch operations. "
                   "auto = on on CUDA without --compile, else off.")
@click.option("--json", "as_json", is_flag=True, help="Print exactly one JSON object (text and statistics) "
              "on stdout instead of streaming.")
@click.option("--server", default=None, metavar="HOST:PORT",
              help="Generate on a running Triton server's treeflash model instead of in process "
                   "(see treeflash-export triton-repo); the model, tree and cache are the server's.")
@click.option("--server-protocol", type=click.Choice(["grpc", "http"]), default="grpc",
              help="grpc: streamed as rounds are accepted; http: one response (Triton's generate endpoint).")
@click.option("--prompts-file", type=click.Path(dir_okay=False), default=None,
              help="Many prompts, one JSON object a line: \"prompt\" and optionally max_new_tokens, temperature, "
                   "top_p, seed (else the options'). Served together with in-flight batching on the torch backend "
                   "(one after another on the others); with --json, one object per line in input order.")
@click.option("--max-batch", type=int, default=8,
              help="--prompts-file on the torch backend: requests served at once (request slots, each with its own "
                   "--max-seq-len cache, all allocated up front).")
@click.option("--tree-size-by-batch", default="", metavar="B:N,...",
              help="--prompts-file: a smaller tree when more requests share a round, e.g. 1:64,4:32,8:16 (the "
                   "largest batch size not above the round's slot bucket applies).")
def main(model, drafter, artifacts, verify_checksums, prompt, chat, mode, tree_size, top_m, top_k,
         drafter_temperature, temperature, top_p, max_new_tokens, seed, stop_token_ids, ignore_eos, max_seq_len,
         backend, device, dtype, cuda_graphs, compile_steps, fast_kernels, as_json, server, server_protocol,
         prompts_file, max_batch, tree_size_by_batch):
    """Generate text from a verifier with TreeFlash tree speculative decoding.

    Greedy output (--temperature 0) is token for token the verifier's own greedy
    output; sampled output follows the verifier's own distribution.
    """
    try:
        _run(**locals())
    except TreeFlashError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)


def _run(model, drafter, artifacts, verify_checksums, prompt, chat, mode, tree_size, top_m, top_k,
         drafter_temperature, temperature, top_p, max_new_tokens, seed, stop_token_ids, ignore_eos, max_seq_len,
         backend, device, dtype, cuda_graphs, compile_steps, fast_kernels, as_json, server, server_protocol,
         prompts_file, max_batch, tree_size_by_batch):
    requested = dict(mode=mode, tree_size=tree_size, top_m=top_m, top_k=top_k,
                     drafter_temperature=drafter_temperature)
    defaults = SamplingConfig(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, seed=seed)
    defaults.validate()
    lines = by_batch = None
    if prompts_file is not None:  # every line checked before any model loads
        from .backends.slots import parse_tree_size_by_batch
        from .offline import read_prompts_file

        if prompt is not None or server is not None:
            raise TreeFlashError("--prompts-file replaces --prompt" + (" and does not run on --server" if server else ""))
        if max_batch < 1:
            raise TreeFlashError(f"--max-batch must be >= 1, got {max_batch}")
        lines = read_prompts_file(prompts_file, defaults)
        by_batch = parse_tree_size_by_batch(tree_size_by_batch)
    elif tree_size_by_batch:
        raise TreeFlashError("--tree-size-by-batch applies to --prompts-file (and to triton-repo --backend torch)")
    if server is not None:
        local = dict(model=model, drafter=drafter, artifacts=artifacts, chat=chat, max_seq_len=max_seq_len,
                     **requested, backend=backend != "torch", device=device != "auto", dtype=dtype != "auto")
        given = [k for k, v in local.items() if v]
        if given:
            raise TreeFlashError(f"--server runs the server's model: --{given[0].replace('_', '-')} does not apply")
        if len(stop_token_ids) > 1:
            raise TreeFlashError("--server takes one --stop-token-id (the request's end_id)")
        end_id = stop_token_ids[0] if stop_token_ids else (-1 if ignore_eos else None)
        return _run_server(server, server_protocol, _read_prompt(prompt), max_new_tokens, temperature, top_p, seed,
                           end_id, as_json)
    if artifacts is None:
        if model and (mode or _TREE.mode) != "ar" and not drafter:
            raise TreeFlashError(f"--drafter is required for --mode {mode or _TREE.mode} "
                                 f"(or use --mode ar for plain decoding)")
    elif model or drafter:
        raise TreeFlashError("--artifacts replaces --model and --drafter: pass one or the other")
    if max_seq_len is not None and max_seq_len < 2:
        raise TreeFlashError(f"--max-seq-len {max_seq_len} is too small")
    if lines is None:
        prompt = _read_prompt(prompt)

    from transformers.utils import logging as hf_logging

    from .factory import DEFAULT_CAPACITY, session_from_artifacts, session_from_checkpoints
    from .loop import generate

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    t_load = time.perf_counter()
    batch = dict(max_batch=max_batch, tree_size_by_batch=by_batch) if lines is not None and backend == "torch" else {}
    if artifacts is None:
        tree = TreeConfig(**{k: v for k, v in requested.items() if v is not None})
        sess = session_from_checkpoints(model or None, drafter, tree, max_seq_len or DEFAULT_CAPACITY, backend,
                                        device, dtype, log=lambda m: click.echo(m, err=True), cuda_graphs=cuda_graphs,
                                        compile_steps=compile_steps, fast_kernels=_ON_OFF[fast_kernels], **batch)
    else:
        sess = session_from_artifacts(artifacts, requested, max_seq_len=max_seq_len, backend=backend,
                                      device=device, dtype=dtype, verify_checksums=verify_checksums,
                                      cuda_graphs=cuda_graphs, compile_steps=compile_steps,
                                      fast_kernels=_ON_OFF[fast_kernels], log=lambda m: click.echo(m, err=True),
                                      **batch)
    load_s = time.perf_counter() - t_load  # checkpoints read, caches allocated
    tree, runner, tok = sess.tree, sess.runner, sess.tokenizer
    if chat and not getattr(tok, "chat_template", None):
        raise TreeFlashError("--chat: this tokenizer has no chat template")
    stops = tuple(sorted(set(stop_token_ids) | (set() if ignore_eos else set(sess.stop_token_ids))))
    resolved = tree.resolved(runner.block_size)
    common = {"mode": resolved.mode, "backend": runner.name, "load_s": load_s, "load_stages_s": sess.load_stages_s,
              "tree_size": resolved.tree_size, "top_m": resolved.top_m, "top_k": resolved.top_k,
              "device": str(runner.device), "dtype": sess.dtype, "artifacts": artifacts}
    if lines is not None:
        return _run_lines(sess, lines, stops, lambda text: _encode(tok, text, chat), common, as_json)
    ids = _encode(tok, prompt, chat)
    sampling = dataclasses.replace(defaults, stop_token_ids=stops)
    streamer = None if as_json else _Streamer(tok, sys.stdout)
    result = generate(runner, ids, tree, sampling, on_tokens=streamer)
    text = tok.decode(result.token_ids, skip_special_tokens=True)
    s = result.stats
    if as_json:
        payload = {
            "text": text, "token_ids": result.token_ids, "mode": s.mode, "backend": s.backend,
            "rounds": s.rounds, "accept_lengths": s.accept_lengths, "mean_accepted": s.mean_accepted,
            "new_tokens": s.new_tokens, "elapsed_s": s.elapsed_s, "tokens_per_s": s.tokens_per_s,
            "prefill_s": s.prefill_s, "prompt_tokens": s.prompt_tokens, "stop_reason": result.stop_reason,
            # start-up: loading, then the first begin (graph capture and kernel compilation on a first
            # run of a setting, then the prefill) up to the first token
            "load_s": load_s, "load_stages_s": sess.load_stages_s, "first_token_s": load_s + s.prefill_s,
            "tree_size": resolved.tree_size, "top_m": resolved.top_m, "top_k": resolved.top_k,
            "temperature": temperature, "top_p": top_p, "seed": seed, "device": str(runner.device), "dtype": sess.dtype,
            "artifacts": artifacts,
        }
        sys.stdout.write(json.dumps(payload) + "\n")
    else:
        sys.stdout.write(streamer.text.flush() + "\n")  # the held-back end, if generation stopped mid-character
        click.echo(
            f"[{s.mode}/{s.backend}] {s.new_tokens} tokens in {s.rounds} rounds, "
            f"{s.mean_accepted:.2f} tokens/round, {s.tokens_per_s:.1f} tok/s ({result.stop_reason})",
            err=True,
        )


def _encode(tok, text: str, chat: bool) -> list[int]:
    if not chat:
        return tok(text, add_special_tokens=True)["input_ids"]
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                                  return_dict=False)
    return ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids


def _run_lines(sess, lines, stops, encode, common, as_json) -> None:
    """--prompts-file: all lines through the engine (or one by one), then the results in input order."""
    from tqdm import tqdm

    from .offline import run_prompt_lines

    lines = [dataclasses.replace(line, sampling=dataclasses.replace(line.sampling, stop_token_ids=stops))
             for line in lines]
    if not hasattr(sess.runner, "max_batch"):
        click.echo(f"note: the {sess.runner.name} backend serves one sequence at a time: the prompts run one after "
                   f"another", err=True)
    t0 = time.perf_counter()
    with tqdm(total=len(lines), desc="requests", unit="req", file=sys.stderr, leave=False) as bar:
        results = run_prompt_lines(sess, lines, encode, bar.update)
    elapsed = time.perf_counter() - t0
    for line, r in zip(lines, results):
        text = sess.tokenizer.decode(r["token_ids"], skip_special_tokens=True)
        if as_json:
            payload = {"text": text, **r, **common, "first_token_s": common["load_s"] + r["prefill_s"], "line": line.line}
            sys.stdout.write(json.dumps(payload) + "\n")
        else:
            sys.stdout.write(f"--- line {line.line} ({r['new_tokens']} tokens, {r['stop_reason']})\n{text}\n")
    total = sum(r["new_tokens"] for r in results)
    click.echo(f"[{common['mode']}/{common['backend']}] {len(results)} prompts, {total} tokens in {elapsed:.2f} s, "
               f"{total / elapsed if elapsed else 0.0:.1f} tok/s in all", err=True)


def _read_prompt(prompt: str | None) -> str:
    if prompt is None:
        if sys.stdin is None or sys.stdin.isatty():
            raise TreeFlashError("no prompt: pass --prompt TEXT or pipe text on standard input")
        prompt = sys.stdin.read()
    if not prompt:
        raise TreeFlashError("the prompt is empty")
    return prompt


def _run_server(server, protocol, prompt, max_new_tokens, temperature, top_p, seed, end_id, as_json):
    from .serving.client import generate_http, request_inputs, stream_grpc

    def write(piece):
        sys.stdout.write(piece)
        sys.stdout.flush()

    inputs = request_inputs(prompt, max_new_tokens, stream=protocol == "grpc", temperature=temperature, top_p=top_p,
                            random_seed=seed, end_id=end_id)
    if protocol == "grpc":
        r = stream_grpc(server, inputs, on_text=None if as_json else write)
    else:
        r = generate_http(server, inputs)
        if not as_json:
            write(r.text)
    if as_json:
        payload = dict(r.to_dict(), server=server, protocol=protocol, temperature=temperature, top_p=top_p, seed=seed,
                       tokens_per_s=r.new_tokens / r.elapsed_s if r.elapsed_s else 0.0)
        sys.stdout.write(json.dumps(payload) + "\n")
    else:
        sys.stdout.write("\n")
        click.echo(f"[server {server}] {r.new_tokens} tokens in {r.rounds} rounds, {r.mean_accepted:.2f} tokens/round, "
                   f"first response after {r.ttft_s * 1000:.0f} ms, {r.elapsed_s:.2f} s in all ({r.stop_reason})",
                   err=True)


if __name__ == "__main__":
    main()
