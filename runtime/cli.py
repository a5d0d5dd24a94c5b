"""`treeflash-run`: generate text with tree speculative decoding (or plain decoding as the baseline)."""

from __future__ import annotations

import dataclasses
import json
import sys
import time

import click

from treeflash_export.config import SamplingConfig
from treeflash_export.errors import TreeFlashError

from .options import check_model_options, load_session, model_options

_SAMPLING = SamplingConfig()


class _Streamer:
    """Prints decoded text as tokens arrive, holding back incomplete UTF-8 sequences."""

    def __init__(self, tokenizer, stream):
        from .serving.text import IncrementalText

        self.text, self.stream = IncrementalText(tokenizer), stream

    def __call__(self, new: list[int]) -> None:
        piece = self.text.add(new)
        if piece:
            self.stream.write(piece)
            self.stream.flush()


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@model_options
@click.option("--prompt", default=None, help="Prompt text; read from standard input when omitted.")
@click.option("--chat/--no-chat", default=False, help="Wrap the prompt in the tokenizer's chat template.")
@click.option("--temperature", type=float, default=_SAMPLING.temperature, help="Verifier temperature; 0 = greedy.")
@click.option("--top-p", type=float, default=_SAMPLING.top_p, help="Verifier nucleus sampling mass.")
@click.option("--max-new-tokens", type=int, default=_SAMPLING.max_new_tokens)
@click.option("--seed", type=int, default=_SAMPLING.seed, help="Seed of the verifier's sampling.")
@click.option("--stop-token-id", "stop_token_ids", type=int, multiple=True,
              help="Extra token id that ends generation (repeatable); EOS ids are added unless --ignore-eos.")
@click.option("--ignore-eos", is_flag=True, help="Do not stop at the default stop set: the tokenizer's and generation config's EOS ids and the chat template's end-of-turn token.")
@click.option("--backend", type=click.Choice(["torch", "onnxruntime", "tensorrt"]), default="torch",
              help="Runtime backend; onnxruntime and tensorrt run an artifact folder.")
@click.option("--compile/--no-compile", "compile_steps", default=False,
              help="torch backend: torch.compile the prefill pass, the round and the plain step (Inductor fuses "
                   "the elementwise work; minutes the first time, cached under TREEFLASH_CACHE after).")
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
def main(model, drafter, artifacts, verify_checksums, prompt, chat, mode, tree_size, top_m, top_k, retune,
         draft_vocab, drafter_temperature, temperature, top_p, max_new_tokens, seed, stop_token_ids, ignore_eos, max_seq_len,
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


def _run(model, drafter, artifacts, verify_checksums, prompt, chat, mode, tree_size, top_m, top_k, retune,
         draft_vocab, drafter_temperature, temperature, top_p, max_new_tokens, seed, stop_token_ids, ignore_eos, max_seq_len,
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
                     **requested, backend=backend != "torch", device=device != "auto", dtype=dtype != "auto",
                     draft_vocab=draft_vocab != "auto")
        given = [k for k, v in local.items() if v]
        if given:
            raise TreeFlashError(f"--server runs the server's model: --{given[0].replace('_', '-')} does not apply")
        if len(stop_token_ids) > 1:
            raise TreeFlashError("--server takes one --stop-token-id (the request's end_id)")
        end_id = stop_token_ids[0] if stop_token_ids else (-1 if ignore_eos else None)
        return _run_server(server, server_protocol, _read_prompt(prompt), max_new_tokens, temperature, top_p, seed,
                           end_id, as_json)
    check_model_options(model, drafter, artifacts, mode, max_seq_len)
    if lines is None:
        prompt = _read_prompt(prompt)

    from transformers.utils import logging as hf_logging

    from .loop import generate

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    t_load = time.perf_counter()
    batch = dict(max_batch=max_batch, tree_size_by_batch=by_batch) if lines is not None and backend == "torch" else {}
    sess = load_session(model=model, drafter=drafter, artifacts=artifacts, verify_checksums=verify_checksums,
                        **requested, max_seq_len=max_seq_len, device=device, dtype=dtype, cuda_graphs=cuda_graphs,
                        fast_kernels=fast_kernels, backend=backend, compile_steps=compile_steps,
                        log=lambda m: click.echo(m, err=True), retune=retune, draft_vocab=draft_vocab,
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
    result = generate(runner, ids, tree, sampling, on_tokens=streamer, tuner=sess.tuner)
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
        if s.tuning is not None:  # the settings the self-tuning tree ran, its latest choice and the costs
            payload.update(tree_size=None, top_m=None, top_k=None, tuning=s.tuning)
        sys.stdout.write(json.dumps(payload) + "\n")
    else:
        sys.stdout.write(streamer.text.flush() + "\n")  # the held-back end, if generation stopped mid-character
        used = ""
        if s.tuning is not None:
            top = sorted(s.tuning["settings_used"].items(), key=lambda kv: -kv[1])[:3]
            used = "; rounds by setting: " + ", ".join(f"{k} {v}" for k, v in top)
        click.echo(
            f"[{s.mode}/{s.backend}] {s.new_tokens} tokens in {s.rounds} rounds, "
            f"{s.mean_accepted:.2f} tokens/round, {s.tokens_per_s:.1f} tok/s ({result.stop_reason}){used}",
            err=True,
        )


def _encode(tok, text: str, chat: bool) -> list[int]:
    from .serving.text import encode_chat, encode_prompt

    return encode_chat(tok, [{"role": "user", "content": text}]) if chat else encode_prompt(tok, text)


def _run_lines(sess, lines, stops, encode, common, as_json) -> None:
    """--prompts-file: all lines through the engine (or one by one), then the results in input order."""
    from tqdm import tqdm

    from .offline import run_prompt_lines

    lines = [dataclasses.replace(line, sampling=dataclasses.replace(line.sampling, stop_token_ids=stops))
             for line in lines]
    if sess.runner.max_batch == 1:
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
