"""`treeflash-run`: generate text with tree speculative decoding (or plain decoding as the baseline)."""

from __future__ import annotations

import json
import sys

import click

from treeflash_export.config import MODES, SamplingConfig, TreeConfig
from treeflash_export.errors import TreeFlashError

_TREE = TreeConfig()
_SAMPLING = SamplingConfig()


class _Streamer:
    """Prints decoded text as tokens arrive, holding back incomplete UTF-8 sequences."""

    def __init__(self, tokenizer, stream):
        self.tokenizer, self.stream = tokenizer, stream
        self.tokens: list[int] = []
        self.printed = 0

    def __call__(self, new: list[int]) -> None:
        self.tokens.extend(new)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return
        self.stream.write(text[self.printed:])
        self.stream.flush()
        self.printed = len(text)


def _pick_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise TreeFlashError(f"--device {device} asked for, but this torch build sees no CUDA GPU")
    return device


def _stop_ids(tokenizer, verifier, extra: tuple[int, ...], ignore_eos: bool) -> tuple[int, ...]:
    ids = set(extra)
    if not ignore_eos:
        for source in (getattr(tokenizer, "eos_token_id", None),
                       getattr(getattr(verifier, "generation_config", None), "eos_token_id", None)):
            if isinstance(source, int):
                ids.add(source)
            elif isinstance(source, (list, tuple)):
                ids.update(int(i) for i in source)
    return tuple(sorted(ids))


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--model", "model", required=True, help="Verifier: a local Hugging Face folder or a hub id.")
@click.option("--drafter", default=None, help="TreeFlash or DFlash drafter: a local folder or a hub id "
              "(not needed with --mode ar).")
@click.option("--prompt", default=None, help="Prompt text; read from standard input when omitted.")
@click.option("--chat/--no-chat", default=False, help="Wrap the prompt in the tokenizer's chat template.")
@click.option("--mode", type=click.Choice(MODES), default=_TREE.mode,
              help="treeflash: head-conditioned tree; marginal: DDTree-style tree; chain: DFlash path; "
                   "ar: plain decoding on the same backend (the baseline).")
@click.option("--tree-size", type=int, default=_TREE.tree_size, help="Tree nodes per round N, root included.")
@click.option("--top-m", type=int, default=_TREE.top_m, help="Candidate parents per position (treeflash).")
@click.option("--top-k", type=int, default=_TREE.top_k, help="Children per parent row.")
@click.option("--drafter-temperature", type=float, default=_TREE.drafter_temperature,
              help="Temperature of the drafter scores that shape the tree (never changes the output).")
@click.option("--temperature", type=float, default=_SAMPLING.temperature, help="Verifier temperature; 0 = greedy.")
@click.option("--top-p", type=float, default=_SAMPLING.top_p, help="Verifier nucleus sampling mass.")
@click.option("--max-new-tokens", type=int, default=_SAMPLING.max_new_tokens)
@click.option("--seed", type=int, default=_SAMPLING.seed, help="Seed of the verifier's sampling.")
@click.option("--stop-token-id", "stop_token_ids", type=int, multiple=True,
              help="Extra token id that ends generation (repeatable); EOS ids are added unless --ignore-eos.")
@click.option("--ignore-eos", is_flag=True, help="Do not stop at the tokenizer's / model's EOS tokens.")
@click.option("--max-seq-len", type=int, default=2048, help="KV cache capacity S (prompt + new tokens + tree).")
@click.option("--backend", type=click.Choice(["torch"]), default="torch", help="Runtime backend.")
@click.option("--device", default="auto", help="auto, cpu, cuda or cuda:N.")
@click.option("--dtype", type=click.Choice(["auto", "float32", "float16", "bfloat16"]), default="auto",
              help="auto = float32 on CPU, bfloat16 on CUDA.")
@click.option("--json", "as_json", is_flag=True, help="Print exactly one JSON object (text and statistics) "
              "on stdout instead of streaming.")
def main(model, drafter, prompt, chat, mode, tree_size, top_m, top_k, drafter_temperature, temperature, top_p,
         max_new_tokens, seed, stop_token_ids, ignore_eos, max_seq_len, backend, device, dtype, as_json):
    """Generate text from a verifier with TreeFlash tree speculative decoding.

    Greedy output (--temperature 0) is token for token the verifier's own greedy
    output; sampled output follows the verifier's own distribution.
    """
    try:
        _run(**locals())
    except TreeFlashError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)


def _run(model, drafter, prompt, chat, mode, tree_size, top_m, top_k, drafter_temperature, temperature, top_p,
         max_new_tokens, seed, stop_token_ids, ignore_eos, max_seq_len, backend, device, dtype, as_json):
    tree = TreeConfig(mode=mode, tree_size=tree_size, top_m=top_m, top_k=top_k,
                      drafter_temperature=drafter_temperature)
    SamplingConfig(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, seed=seed).validate()
    if mode != "ar" and not drafter:
        raise TreeFlashError(f"--drafter is required for --mode {mode} (or use --mode ar for plain decoding)")
    if prompt is None:
        if sys.stdin is None or sys.stdin.isatty():
            raise TreeFlashError("no prompt: pass --prompt TEXT or pipe text on standard input")
        prompt = sys.stdin.read()
    if not prompt:
        raise TreeFlashError("the prompt is empty")
    if max_seq_len < 2:
        raise TreeFlashError(f"--max-seq-len {max_seq_len} is too small")

    import torch
    from transformers.utils import logging as hf_logging

    from treeflash_export.checkpoints import load_pair, parse_dtype

    from .backends import get_runner_class
    from .loop import generate

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    dev = _pick_device(device)
    torch_dtype = parse_dtype(dtype if dtype != "auto" else ("bfloat16" if dev.startswith("cuda") else "float32"))
    def check(vcfg, dcfg):
        if dcfg is not None:
            tree.validate(block_size=dcfg.block_size, vocab_size=dcfg.vocab_size, has_head=dcfg.has_head)

    pair = load_pair(model, drafter if mode != "ar" else None, dtype=torch_dtype, device=dev, check=check)
    tok = pair.tokenizer
    if chat:
        if not getattr(tok, "chat_template", None):
            raise TreeFlashError("--chat: this tokenizer has no chat template")
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
    else:
        ids = tok(prompt, add_special_tokens=True)["input_ids"]
    sampling = SamplingConfig(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, seed=seed,
                              stop_token_ids=_stop_ids(tok, pair.verifier, stop_token_ids, ignore_eos))
    runner = get_runner_class(backend)(pair.verifier, pair.drafter, capacity=max_seq_len)
    streamer = None if as_json else _Streamer(tok, sys.stdout)
    result = generate(runner, ids, tree, sampling, on_tokens=streamer)
    text = tok.decode(result.token_ids, skip_special_tokens=True)
    s = result.stats
    if as_json:
        resolved = tree.resolved(runner.block_size)
        payload = {
            "text": text, "token_ids": result.token_ids, "mode": s.mode, "backend": s.backend,
            "rounds": s.rounds, "accept_lengths": s.accept_lengths, "mean_accepted": s.mean_accepted,
            "new_tokens": s.new_tokens, "elapsed_s": s.elapsed_s, "tokens_per_s": s.tokens_per_s,
            "prefill_s": s.prefill_s, "prompt_tokens": s.prompt_tokens, "stop_reason": result.stop_reason,
            "tree_size": resolved.tree_size, "top_m": resolved.top_m, "top_k": resolved.top_k,
            "temperature": temperature, "top_p": top_p, "seed": seed, "device": dev, "dtype": str(torch_dtype),
        }
        sys.stdout.write(json.dumps(payload) + "\n")
    else:
        sys.stdout.write("\n")
        click.echo(
            f"[{s.mode}/{s.backend}] {s.new_tokens} tokens in {s.rounds} rounds, "
            f"{s.mean_accepted:.2f} tokens/round, {s.tokens_per_s:.1f} tok/s ({result.stop_reason})",
            err=True,
        )


if __name__ == "__main__":
    main()
