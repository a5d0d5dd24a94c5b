"""`treeflash-bench`: speculative vs plain decoding, and backend vs backend, side by side in one run.

Every configuration runs the same prompts in one process on one machine, after a
warm-up generation; the report gives tokens per round, tokens per second, and
ratios against plain decoding (mode ar) on the same backend and against the
first backend for the same mode. At temperature 0 it also checks that every
configuration produced the same tokens.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter

import click

from treeflash_export.config import MODES, SamplingConfig, TreeConfig
from treeflash_export.errors import TreeFlashError
from treeflash_export.presets import PRESETS

from ..options import AutoOrInt
from .batching import sixteen_bit_note

DEFAULT_PROMPTS = (
    "def quicksort(items):\n",
    "The history of the printing press",
    "import json\n\ndef load_config(path):\n",
)


def _split(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _session(artifacts, model, drafter, backend, mode, tree_kw, max_seq_len, device, mode_auto=False,
             draft_vocab=None):
    """One loaded runner per backend: every tree setting (and plain decoding) runs on it."""
    from ..factory import DEFAULT_CAPACITY, session_from_artifacts, session_from_checkpoints

    if artifacts:
        return session_from_artifacts(artifacts, {}, backend=backend, device=device)
    tree = TreeConfig(mode=mode, **tree_kw)
    return session_from_checkpoints(model, drafter, tree, max_seq_len or DEFAULT_CAPACITY, backend, device,
                                    log=lambda m: click.echo(m, err=True), mode_auto=mode_auto,
                                    draft_vocab=draft_vocab)


def reply_sampling(sess, max_new_tokens: int, ignore_eos: bool = False) -> SamplingConfig:
    """Greedy replies that end where a user's would: at the pair's stop tokens (unless ignore_eos)
    or after max_new_tokens (the benchmark's rows and the replay's tapes alike)."""
    stops = () if ignore_eos else tuple(sorted(sess.stop_token_ids))
    return SamplingConfig(max_new_tokens=max_new_tokens, stop_token_ids=stops)


def _tree_for(sess, artifacts, mode, size, tree_kw) -> TreeConfig:
    if mode == "ar":
        return TreeConfig(mode="ar")
    if mode == "auto":  # the self-tuning tree picks each round's (run_bench passes it the tuner)
        return TreeConfig()
    if artifacts:  # the graphs fix the tree
        if mode != sess.tree.mode:
            raise TreeFlashError(f"the artifact was built for mode {sess.tree.mode!r}; benchmarking "
                                 f"{mode!r} needs an artifact built with --mode {mode}")
        return sess.tree
    return TreeConfig(mode=mode, **(dict(tree_kw, tree_size=size) if size else tree_kw))


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--artifacts", default=None, type=click.Path(file_okay=False), help="An artifact folder.")
@click.option("--model", default=None, help="Verifier checkpoint (torch backend, without --artifacts).")
@click.option("--drafter", default=None, help="Drafter checkpoint (torch backend, without --artifacts); without "
              "--model it drafts for the default verifier, SmolLM2-135M-Instruct.")
@click.option("--backends", default="torch", help="Comma-separated backends; the first is the reference.")
@click.option("--modes", default=None, help="Comma-separated modes (auto: the self-tuning tree); 'ar' (plain "
              "decoding) is always added. [default: the artifact's mode, or auto]")
@click.option("--sweep", is_flag=True,
              help="Time a grid of fixed settings in one run (TreeFlash at every --sweep-sizes x --sweep-top-m x "
                   "--sweep-top-k, the marginal tree at every size and K, the chain, plain decoding) beside auto, "
                   "sorted by tokens/s, with where auto lands against the best point (torch over checkpoints).")
@click.option("--sweep-sizes", default="4,8,16,32,64", metavar="N,...", help="With --sweep: tree sizes.")
@click.option("--sweep-top-m", default="1,2,4,16", metavar="M,...", help="With --sweep: top-M values.")
@click.option("--sweep-top-k", default="4,16", metavar="K,...", help="With --sweep: top-K values.")
@click.option("--plot", default=None, type=click.Path(dir_okay=False),
              help="With --sweep: also draw tokens/s over tree size to this PNG file.")
@click.option("--tree-sizes", default=None,
              help="Comma-separated tree sizes N (checkpoints only; an artifact has its own). "
                   f"[default: {TreeConfig.tree_size}; 16,32,64 with --random-weights]")
@click.option("--top-m", type=int, default=TreeConfig.top_m)
@click.option("--top-k", type=int, default=TreeConfig.top_k)
@click.option("--draft-vocab", type=AutoOrInt(), default="auto", show_default=True,
              help="Checkpoints: how many tokens the drafter ranks (see treeflash-run --draft-vocab); 0: the whole "
                   "vocabulary.")
@click.option("--prompt", "prompts", multiple=True, help="Prompt (repeatable). [default: three built-in prompts]")
@click.option("--chat", is_flag=True, help="Wrap each --prompt in the tokenizer's chat template (as treeflash-run "
              "--chat does).")
@click.option("--heldout-prompts", type=int, default=0,
              help="Instead, K prompts cut from the held-out part of the training corpus (never trained on).")
@click.option("--heldout-domain", type=click.Choice(["code", "chat-stdlib", "chat-prose", "chat-self"]),
              default="code",
              help="With --heldout-prompts: the training source they come from; chat domains are chat-templated "
                   "requests about held-out modules or Shakespeare passages; chat-self the held-out user turns the "
                   "verifier writes itself (generated once per verifier and cached).")
@click.option("--prompt-tokens", type=int, default=48, help="Length of each held-out code prompt in tokens.")
@click.option("--max-new-tokens", type=int, default=64)
@click.option("--ignore-eos", is_flag=True,
              help="Generate --max-new-tokens every time; by default a generation ends at the model's end-of-turn "
                   "or EOS token, as treeflash-run's does.")
@click.option("--max-seq-len", type=int, default=None)
@click.option("--repeat", type=int, default=1, help="Timed repetitions per prompt (after one warm-up); with --concurrency, runs of each "
              "variant and concurrency, the variants taking turns, each row showing the median run.")
@click.option("--device", default="auto")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
@click.option("--server", default=None, metavar="HOST:PORT",
              help="Instead: time to first token and inter-token latency in process (ONNX Runtime over "
                   "--artifacts) vs through this Triton server's treeflash model (serving the same artifact).")
@click.option("--concurrency", default=None, metavar="C,...",
              help="In process (without --server): serve --requests distinct prompts through the in-flight "
                   "batching engine at each of these concurrencies (e.g. 1,4,8; torch backend) and report "
                   "tokens/s, time to first token, inter-token latency and whether outputs match concurrency 1. "
                   "With --server: the same, through the server (after an in-process row). [default with "
                   "--server: 1,8]")
@click.option("--openai", "openai_url", default=None, metavar="URL",
              help="Instead: the same rows through an OpenAI-compatible server (treeflash-serve, e.g. "
                   "http://127.0.0.1:8000): streamed greedy completions at each --concurrency [default: 1,8], "
                   "tokens/s, time to first token, inter-token latency, and whether outputs equal the first row's.")
@click.option("--api-key", default=None, envvar="TREEFLASH_API_KEY", help="With --openai: the server's API key.")
@click.option("--requests", type=int, default=16, help="With --concurrency, --server or --openai: distinct prompts "
              "per row.")
@click.option("--server-model", default="treeflash", help="With --server: the served model to load.")
@click.option("--tree-size-by-batch", default="", metavar="B:N,...[;B:N,...]",
              help="With --concurrency: a smaller tree when more requests share a round (see treeflash-run); "
                   "several tables separated by ';' are benchmarked one after another, each as a variant of every "
                   "fixed mode in --modes.")
@click.option("--random-weights", "preset", default=None, type=click.Choice(sorted(PRESETS)),
              help="Instead: time rounds and plain steps of a random-weight pair at this model's shapes, built "
                   "on the device (no download), against the weight-reading floor.")
@click.option("--prompt-lengths", default="512,8192", help="With --random-weights: comma-separated prompt lengths.")
@click.option("--rounds", type=int, default=32, help="With --random-weights: timed rounds (or steps) per row.")
@click.option("--warmup", type=int, default=3, help="With --random-weights: untimed rounds before them.")
@click.option("--tokens-per-round", type=float, default=3.0,
              help="With --random-weights: the tokens per round assumed for the implied speed-up.")
@click.option("--dtype", type=click.Choice(["auto", "float32", "float16", "bfloat16"]), default="auto",
              help="With --random-weights: auto = bfloat16 on CUDA, float32 on CPU.")
@click.option("--cuda-graphs/--no-cuda-graphs", default=True, help="torch backend on CUDA: replay captured rounds.")
@click.option("--compile/--no-compile", "compile_steps", default=False,
              help="With --random-weights: torch.compile the steps (see treeflash-run --compile).")
@click.option("--fast-kernels", type=click.Choice(["auto", "on", "off", "both"]), default="auto",
              help="With --random-weights: the project's fast kernels on or off (see treeflash-run "
                   "--fast-kernels), or both side by side in one run.")
@click.option("--batch-sizes", default="", metavar="B,...",
              help="With --random-weights: also time the request-slot runner's rounds (in-flight batching) at "
                   "these batch sizes for every tree setting, e.g. 1,4,8,16 (round time against slots x N).")
@click.option("--slot-costs", default=None, metavar="S,...",
              help="Instead: a short request's prefill and release at each of these cache capacities per slot "
                   "(e.g. 2048,16384), two request slots each, torch backend: they must not grow with the capacity.")
@click.option("--stages/--no-stages", default=True,
              help="With --random-weights: also time each stage of a round (inside the CUDA graph where graphs "
                   "are on, else eagerly and synchronised; not with --compile).")
def main(artifacts, model, drafter, backends, modes, sweep, sweep_sizes, sweep_top_m, sweep_top_k, plot, tree_sizes, top_m, top_k, draft_vocab, prompts, chat, heldout_prompts,
         heldout_domain, prompt_tokens, max_new_tokens, ignore_eos, max_seq_len, repeat, device, as_json, server,
         concurrency, openai_url, api_key, requests, server_model, tree_size_by_batch, preset, prompt_lengths, rounds, warmup, tokens_per_round, dtype,
         cuda_graphs, compile_steps, fast_kernels, batch_sizes, slot_costs, stages):
    """Benchmark tree speculative decoding against plain decoding (and backends against each other).

    Without --artifacts and --model, it benchmarks the default pair (SmolLM2-135M-Instruct and the
    demo drafter). With --server and --artifacts, it benchmarks serving instead; with
    --random-weights PRESET, round and step times at real shapes.
    """
    if preset is not None:
        _random_main(preset, modes, tree_sizes, top_m, top_k, prompt_lengths, rounds, warmup, tokens_per_round,
                     device, dtype, cuda_graphs, compile_steps, fast_kernels, stages, as_json, batch_sizes)
        return
    tree_sizes = tree_sizes or str(TreeConfig.tree_size)
    draft_vocab = None if draft_vocab == "auto" else draft_vocab
    if slot_costs is not None:
        _slot_cost_main(model, drafter, list(prompts) or list(DEFAULT_PROMPTS), _split(slot_costs), device,
                        cuda_graphs, as_json)
        return
    if openai_url is not None:
        _openai_main(openai_url, api_key, list(prompts) or list(DEFAULT_PROMPTS), max_new_tokens,
                     [int(c) for c in _split(concurrency or "1,8")], requests, ignore_eos, as_json)
        return
    if server is not None:
        _serving_main(artifacts, server, list(prompts) or list(DEFAULT_PROMPTS), max_new_tokens,
                      [int(c) for c in _split(concurrency or "1,8")], requests, as_json, server_model)
        return
    if concurrency is not None:
        _batching_main(artifacts, model, drafter, modes, tree_sizes, top_m, top_k, list(prompts) or list(DEFAULT_PROMPTS),
                       max_new_tokens, ignore_eos, max_seq_len, device, concurrency, requests, tree_size_by_batch,
                       cuda_graphs, as_json, draft_vocab, repeat)
        return
    try:
        source = (("heldout", heldout_prompts, prompt_tokens, heldout_domain) if heldout_prompts
                  else ("chat", list(prompts) or list(DEFAULT_PROMPTS)) if chat else list(prompts) or list(DEFAULT_PROMPTS))
        grid = None
        if sweep:
            grid = tuple([int(x) for x in _split(v)] for v in (sweep_sizes, sweep_top_m, sweep_top_k))
        elif plot:
            raise TreeFlashError("--plot draws a --sweep: add --sweep")
        report = run_bench(artifacts, model, drafter, _split(backends), modes,
                           [int(n) for n in _split(tree_sizes)], dict(top_m=top_m, top_k=top_k), source,
                           max_new_tokens, max_seq_len, repeat, device, ignore_eos=ignore_eos, sweep=grid,
                           draft_vocab=draft_vocab)
        if plot:
            plot_sweep(report, plot)
    except TreeFlashError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    if as_json:
        sys.stdout.write(json.dumps(report) + "\n")
    else:
        click.echo(format_report(report))


def _random_main(preset, modes, tree_sizes, top_m, top_k, prompt_lengths, rounds, warmup, tokens_per_round,
                 device, dtype, cuda_graphs, compile_steps, fast_kernels, stages, as_json, batch_sizes=""):
    from .random_weights import format_random_report, run_random_bench

    try:
        report = run_random_bench(
            preset, modes=_split(modes or "chain,marginal,treeflash"),
            tree_sizes=[int(n) for n in _split(tree_sizes or "16,32,64")], top_m=top_m, top_k=top_k,
            prompt_lengths=[int(n) for n in _split(prompt_lengths)], rounds=rounds, warmup=warmup,
            tokens_per_round=tokens_per_round, device=device, dtype=dtype, cuda_graphs=cuda_graphs,
            compile_steps=compile_steps, stages=stages,
            fast_kernels={"auto": (None,), "on": (True,), "off": (False,), "both": (True, False)}[fast_kernels],
            batch_sizes=tuple(int(b) for b in _split(batch_sizes)), log=lambda m: click.echo(m, err=True))
    except (TreeFlashError, ValueError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    click.echo(json.dumps(report) if as_json else format_random_report(report))
    if report["failed"]:  # the other path's rows are printed above, but the run did not succeed
        label, message = next(iter(report["failed"].items()))
        click.echo(f"error: the {label} path failed: {message.splitlines()[0]}", err=True)
        sys.exit(1)


def _batching_main(artifacts, model, drafter, modes, tree_sizes, top_m, top_k, prompts, max_new_tokens, ignore_eos,
                   max_seq_len, device, concurrency, requests, tree_size_by_batch, cuda_graphs, as_json, draft_vocab=None,
                   repeat=1):
    from ..backends.slots import parse_tree_size_by_batch
    from ..factory import DEFAULT_CAPACITY, build_tuner, session_from_artifacts, session_from_checkpoints
    from .batching import format_batching_report, run_batching_bench
    from .server import distinct_prompts

    try:
        levels = [int(c) for c in _split(concurrency)]
        if requests < 1:
            raise TreeFlashError("--requests must be >= 1")
        mode_list = _split(modes) if modes else (["auto"] if not artifacts else [])
        tables = [parse_tree_size_by_batch(t) for t in tree_size_by_batch.split(";") if t.strip()]
        log = lambda m: click.echo(m, err=True)  # noqa: E731
        batch = dict(max_batch=max(levels))
        if artifacts:
            mode = mode_list[0] if mode_list else None
            if len(mode_list) > 1 or mode == "auto" or len(tables) > 1:
                raise TreeFlashError("an artifact serves its own tree: one mode and one --tree-size-by-batch table")
            sess = session_from_artifacts(artifacts, {} if mode is None else {"mode": mode}, backend="torch",
                                          device=device, cuda_graphs=cuda_graphs, log=log,
                                          tree_size_by_batch=tables[0] if tables else None, **batch)
            variants = None
        else:
            largest = TreeConfig(mode="treeflash", tree_size=max(int(n) for n in _split(tree_sizes)), top_m=top_m,
                                 top_k=top_k)
            # The deployment's rounds are captured at start-up only where a fixed tree variant runs them.
            sess = session_from_checkpoints(model, drafter, largest, max_seq_len or DEFAULT_CAPACITY, "torch", device,
                                            cuda_graphs=cuda_graphs, log=log, mode_auto="auto" in mode_list,
                                            draft_vocab=draft_vocab, **batch,
                                            capture_at_start=any(m not in ("auto", "ar", "chain") for m in mode_list))
            variants = []
            for m in [m for m in mode_list if m != "ar"] + ["ar"]:
                if m == "auto":
                    variants.append(("auto", sess.tree, None, build_tuner(sess, log=log)))
                elif m in ("ar", "chain"):
                    variants.append((m, TreeConfig(mode=m), None, None))
                else:
                    tree = TreeConfig(mode=m, tree_size=int(_split(tree_sizes)[0]), top_m=top_m, top_k=top_k)
                    for t in tables or [{}]:
                        label = m + (" " + ",".join(f"{b}:{n}" for b, n in t.items()) if t else f" N={tree.tree_size}")
                        variants.append((label, tree, t, None))
        ids = [sess.tokenizer(p)["input_ids"] for p in distinct_prompts(prompts, requests)]
        report = run_batching_bench(sess, ids, levels, max_new_tokens, () if ignore_eos else sess.stop_token_ids,
                                    variants, repeat)
    except (TreeFlashError, ValueError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    click.echo(json.dumps(report) if as_json else format_batching_report(report))


def _slot_cost_main(model, drafter, prompts, capacities, device, cuda_graphs, as_json):
    from ..factory import session_from_checkpoints
    from .batching import format_slot_cost_report, run_slot_cost_bench

    log = lambda m: click.echo(m, err=True)  # noqa: E731
    tree = TreeConfig(tree_size=16, top_m=4, top_k=8)

    def session(capacity):
        return session_from_checkpoints(model, drafter, tree, capacity, "torch", device, cuda_graphs=cuda_graphs,
                                        log=log, max_batch=2)

    try:
        sizes = [int(c) for c in capacities]
        if not sizes or min(sizes) < 64:
            raise TreeFlashError("--slot-costs takes cache capacities >= 64, e.g. 2048,16384")
        first = session(sizes[0])  # its tokenizer encodes the prompt; its runner times the first capacity
        ids = first.tokenizer(prompts[0])["input_ids"]
        report = run_slot_cost_bench(lambda c: first.runner if c == sizes[0] else session(c).runner, sizes, ids)
    except (TreeFlashError, ValueError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    click.echo(json.dumps(report) if as_json else format_slot_cost_report(report))


def _serving_main(artifacts, server, prompts, max_new_tokens, concurrency, requests, as_json, model="treeflash"):
    from .server import format_serving_report, run_serving_bench

    try:
        if not artifacts:
            raise TreeFlashError("--server needs --artifacts: the artifact folder the server serves, run in process "
                                 "for the side-by-side rows")
        report = run_serving_bench(artifacts, server, prompts, max_new_tokens, concurrency, requests, model)
    except TreeFlashError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    click.echo(json.dumps(report) if as_json else format_serving_report(report))


def _openai_main(url, api_key, prompts, max_new_tokens, concurrency, requests, ignore_eos, as_json):
    from .openai_load import format_openai_report, run_openai_bench

    try:
        report = run_openai_bench(url, prompts, max_new_tokens, concurrency, requests, api_key, ignore_eos)
    except TreeFlashError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    click.echo(json.dumps(report) if as_json else format_openai_report(report))


def _prompt_ids(source, tokenizer, model=None) -> list[list[int]]:
    if isinstance(source, tuple) and source[0] == "chat":
        from ..serving.text import encode_chat

        if not getattr(tokenizer, "chat_template", None):
            raise TreeFlashError("--chat: this tokenizer has no chat template")
        return [encode_chat(tokenizer, [{"role": "user", "content": p}]) for p in source[1]]
    if isinstance(source, tuple):  # ("heldout", count, length, domain): held-out material of a training source
        import random

        from treeflash_export.training.data import sample_prompts
        from treeflash_export.training.sources import corpus_files

        _, count, length, domain = source
        if domain == "chat-self":  # written by the verifier: it needs the verifier's checkpoint
            from treeflash_export.smollm import cache_root, default_verifier
            from treeflash_export.training.self_chat import heldout_turns

            return heldout_turns(model or default_verifier(), tokenizer, count, cache_root() / "heldout-chat-self")
        if domain != "code":
            from treeflash_export.training.chat import heldout_prompts

            return heldout_prompts(domain, tokenizer, count)
        return sample_prompts(corpus_files()[1], tokenizer, count, length, random.Random(1234))
    return [tokenizer(p)["input_ids"] for p in source]


def sweep_settings(sizes, top_ms, top_ks, block_size: int, has_head: bool) -> list[TreeConfig]:
    """The grid of --sweep: TreeFlash at every (N, M, K), the marginal tree at every (N, K), the chain."""
    grid = [TreeConfig(mode="treeflash", tree_size=n, top_m=m, top_k=k) for n in sizes for m in top_ms for k in top_ks
            if has_head]
    grid += [TreeConfig(mode="marginal", tree_size=n, top_m=1, top_k=k) for n in sizes for k in top_ks]
    return grid + [TreeConfig(mode="chain", tree_size=block_size)]


def _label(tree: TreeConfig | None) -> str:
    if tree is None:
        return "auto"
    if tree.mode in ("ar", "chain"):
        return tree.mode
    return f"{tree.mode} N={tree.tree_size}" + (f" M={tree.top_m}" if tree.mode == "treeflash" else "") + \
        f" K={tree.top_k}"


def run_bench(artifacts, model, drafter, backends, modes, tree_sizes, tree_kw, prompts, max_new_tokens,
              max_seq_len, repeat, device, *, ignore_eos: bool = False, sweep: tuple | None = None,
              draft_vocab: int | None = None) -> dict:
    """Speculative rows against plain decoding, side by side on each backend. sweep: (sizes, top_ms,
    top_ks) to time the whole grid of --sweep (torch over checkpoints) besides auto and plain decoding.
    draft_vocab: see TorchRunner (checkpoints only)."""
    from transformers.utils import logging as hf_logging

    from ..factory import build_tuner
    from ..loop import generate

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if modes is None:
        if artifacts:
            from treeflash_export.export.artifact import load_artifact

            modes = load_artifact(artifacts).tree.mode
        else:
            modes = "auto"
    mode_list = [m for m in _split(modes) if m != "ar"] + ["ar"]
    if sweep is not None and "auto" not in mode_list:
        mode_list.insert(0, "auto")
    if ("auto" in mode_list or sweep is not None) and (artifacts or backends != ["torch"]):
        raise TreeFlashError("--modes auto (the self-tuning tree) and --sweep run on the torch backend over checkpoints")
    bad = [m for m in mode_list if m not in MODES + ("auto",)]
    if bad:
        raise TreeFlashError(f"unknown mode {bad[0]!r}; choose from {', '.join(MODES)}")
    rows, outputs = [], {}
    ids = None
    log = lambda m: click.echo(m, err=True)  # noqa: E731
    for backend in backends:
        first = next((m for m in mode_list if m not in ("auto", "ar")), "treeflash" if "auto" in mode_list else "ar")
        sess = _session(artifacts, model, drafter, backend, first, tree_kw, max_seq_len, device,
                        mode_auto="auto" in mode_list, draft_vocab=draft_vocab)
        runner = sess.runner
        dtype = sess.dtype if backend == backends[0] else dtype  # the reference backend's
        tuner = None
        if "auto" in mode_list:
            tuner = build_tuner(sess, log=log)
        if ids is None:
            ids = _prompt_ids(prompts, sess.tokenizer, model)
        sampling = reply_sampling(sess, max_new_tokens, ignore_eos)
        trees: list[TreeConfig | None] = [None] if "auto" in mode_list else []  # None: auto
        if sweep is not None:
            trees += sweep_settings(*sweep, runner.block_size, runner.has_head)
        else:
            trees += [_tree_for(sess, artifacts, m, None, tree_kw) for m in mode_list if m == "chain"]
            trees += [_tree_for(sess, artifacts, m, n, tree_kw) for m in mode_list if m not in ("ar", "chain", "auto")
                      for n in (tree_sizes if not artifacts else [None])]
        trees.append(TreeConfig(mode="ar"))
        for i, tree in enumerate(trees):
            if sweep is not None:
                log(f"sweep: warm-up {i + 1}/{len(trees)} {_label(tree)}")
            # warm-up (and the tuner's start)
            generate(runner, ids[0], tree or TreeConfig(), sampling, tuner=tuner if tree is None else None)
        # Prompt by prompt, every setting in turn (the machine's drift then falls on all of them alike,
        # and each prompt's ratios compare runs minutes apart at most).
        tally = [dict(tokens=0, rounds=0, gained=0, elapsed=0.0, outs=[], used=Counter(),
                      per_prompt=[[0, 0.0] for _ in ids],  # per prompt: tokens, seconds
                      runs=[[0.0] * len(ids) for _ in range(repeat)]) for _ in trees]  # per run and prompt: tok/s
        for r in range(repeat):
            for j, p in enumerate(ids):
                if sweep is not None:
                    log(f"sweep: prompt {j + 1}/{len(ids)}" + (f", run {r + 1}/{repeat}" if repeat > 1 else ""))
                for tree, t in zip(trees, tally):
                    tuned = tuner if tree is None else None
                    t0 = time.perf_counter()
                    res = generate(runner, p, tree or TreeConfig(), sampling, tuner=tuned)
                    took = time.perf_counter() - t0
                    t["elapsed"] += took
                    t["per_prompt"][j][0] += res.stats.new_tokens
                    t["per_prompt"][j][1] += took
                    t["runs"][r][j] = res.stats.new_tokens / took if took else 0.0
                    t["tokens"] += res.stats.new_tokens
                    t["rounds"] += res.stats.rounds
                    t["gained"] += sum(res.stats.accept_lengths)
                    t["outs"].append(res.token_ids)
                    if tuned:
                        t["used"].update(res.stats.tuning["settings_used"])
        for tree, t in zip(trees, tally):
            resolved = None if tree is None else tree.resolved(runner.block_size)
            outputs[backend, _label(resolved)] = t["outs"]
            tokens, rounds, elapsed = t["tokens"], t["rounds"], t["elapsed"]
            row = {"backend": backend, "mode": "auto" if tree is None else tree.mode, "setting": _label(resolved),
                   "tree_size": None if tree is None else resolved.tree_size,
                   "top_m": None if tree is None else resolved.top_m, "top_k": None if tree is None else resolved.top_k,
                   "new_tokens": tokens, "rounds": rounds, "elapsed_s": elapsed,
                   "mean_accepted": t["gained"] / rounds if rounds else 0.0,
                   "tokens_per_s": tokens / elapsed if elapsed else 0.0,
                   "per_prompt_tokens_per_s": [n / s if s else 0.0 for n, s in t["per_prompt"]]}
            if repeat > 1:
                row["per_prompt_tokens_per_s_by_run"] = t["runs"]
            if tree is None:
                row["tuning"] = {**tuner.report(), "settings_used": dict(t["used"])}
            rows.append(row)
    by = {(r["backend"], r["setting"]): r for r in rows}
    for r in rows:
        plain = by[r["backend"], "ar"]
        r["speedup_vs_ar"] = r["tokens_per_s"] / plain["tokens_per_s"]
        r["worst_prompt_vs_ar"] = min(a / b for a, b in zip(r["per_prompt_tokens_per_s"],
                                                            plain["per_prompt_tokens_per_s"]) if b > 0)
        r["ratio_vs_" + backends[0]] = r["tokens_per_s"] / by[backends[0], r["setting"]]["tokens_per_s"]
    reference = next(iter(outputs.values()))
    identical = all(o == reference for o in outputs.values())
    import platform

    import torch

    report = {"rows": rows, "identical_outputs": identical, "prompts": len(ids), "repeat": repeat,
              "max_new_tokens": max_new_tokens, "stops_at_eos": not ignore_eos, "machine": platform.machine(),
              "threads": torch.get_num_threads(), "artifacts": artifacts, "dtype": str(dtype)}
    if repeat > 1 and len(ids) > 1:
        for r in rows:
            r["worst_prompt_vs_ar_held_out"] = slowest_prompt_held_out(
                r["per_prompt_tokens_per_s_by_run"], by[r["backend"], "ar"]["per_prompt_tokens_per_s_by_run"])
        report["plain_vs_itself_worst_prompt"] = {
            r["backend"]: plain_against_itself(r["per_prompt_tokens_per_s_by_run"]) for r in rows if r["mode"] == "ar"}
    if sweep is not None:
        fixed = [r for r in rows if r["mode"] != "auto"]
        best = max(fixed, key=lambda r: r["tokens_per_s"])
        auto = next(r for r in rows if r["mode"] == "auto")
        report["sweep"] = {"best": best["setting"], "best_tokens_per_s": best["tokens_per_s"],
                           "auto_tokens_per_s": auto["tokens_per_s"],
                           "auto_vs_best": auto["tokens_per_s"] / best["tokens_per_s"],
                           "auto_rank": 1 + sum(r["tokens_per_s"] > auto["tokens_per_s"] for r in fixed),
                           "points": len(fixed)}
    return report


def _halves(runs: list[list[float]]) -> tuple[range, range]:
    """The odd runs and the even runs (1st, 3rd, ... and 2nd, 4th, ...), as indices."""
    return range(0, len(runs), 2), range(1, len(runs), 2)


def _mean_secs(runs: list[list[float]], half: range, j: int) -> float:
    """Prompt j's seconds per token, averaged over the runs of half (runs: per run, each prompt's tokens/s)."""
    return sum(1.0 / runs[k][j] for k in half if runs[k][j] > 0) / len(half)


def plain_against_itself(runs: list[list[float]]) -> float:
    """The slowest prompt of plain decoding's odd runs against its even runs, either way round (runs: per
    run, each prompt's tokens/s): how far the machine alone moves a prompt's ratio between runs. A
    row's worst prompt near it says as much about the machine as about the row."""
    worst = 1.0
    for j in range(len(runs[0])):
        secs = [_mean_secs(runs, half, j) for half in _halves(runs)]
        if all(secs):
            worst = min(worst, secs[0] / secs[1], secs[1] / secs[0])
    return worst


def slowest_prompt_held_out(runs: list[list[float]], plain_runs: list[list[float]]) -> float:
    """A row's slowest prompt read held out: the prompt slowest against plain decoding in the odd runs,
    its ratio in the even runs, and the reverse; the lower of the two readings (runs: per run, each
    prompt's tokens/s). The slowest of many prompts read on the runs that chose it picks the prompt
    where the noise fell against the row; read on other runs it says what that prompt runs at."""

    def ratio(half, j):  # plain decoding's time against the row's over those runs (same tokens)
        row = _mean_secs(runs, half, j)
        return _mean_secs(plain_runs, half, j) / row if row else 1.0

    odd, even = _halves(runs)
    readings = []
    for pick, read in ((odd, even), (even, odd)):
        j = min(range(len(runs[0])), key=lambda j: ratio(pick, j))
        readings.append(ratio(read, j))
    return min(readings)


def plot_sweep(report: dict, path: str) -> None:
    """tokens/s over tree size: one line per (mode, M, K), plain decoding and auto as horizontal lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    fig, ax = plt.subplots(figsize=(8, 5))
    lines: dict[str, list] = {}
    for r in rows:
        if r["mode"] in ("treeflash", "marginal"):
            key = f"{r['mode']} M={r['top_m']} K={r['top_k']}" if r["mode"] == "treeflash" else f"marginal K={r['top_k']}"
            lines.setdefault(key, []).append((r["tree_size"], r["tokens_per_s"]))
    for key, pts in sorted(lines.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", lw=1, ms=3,
                ls="--" if key.startswith("marginal") else "-", label=key)
    for r in rows:
        if r["mode"] in ("ar", "auto", "chain"):
            style = {"ar": ("k", "-"), "auto": ("r", "-"), "chain": ("0.5", ":")}[r["mode"]]
            ax.axhline(r["tokens_per_s"], color=style[0], ls=style[1], lw=2 if r["mode"] != "chain" else 1,
                       label=f"{r['mode']} ({r['tokens_per_s']:.1f} tok/s)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tree size N (nodes, root included)")
    ax.set_ylabel("tokens/s")
    ax.set_title(f"treeflash-bench --sweep: {report['prompts']} prompts, {report['max_new_tokens']} new tokens, "
                 f"{report['threads']} threads")
    ax.legend(fontsize=6, ncol=2, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_report(report: dict) -> str:
    rows = report["rows"]
    ref = next(k for k in rows[0] if k.startswith("ratio_vs_"))
    head = (f"{'backend':<12} {'setting':<30} {'tok/round':>9} {'tok/s':>9} {'vs ar':>7} {'worst':>6} "
            f"{ref.replace('ratio_', ''):>12}")
    lines = [head, "-" * len(head)]
    if report.get("sweep"):
        rows = sorted(rows, key=lambda r: -r["tokens_per_s"])
    for r in rows:
        lines.append(f"{r['backend']:<12} {r['setting']:<30} {r['mean_accepted']:>9.2f} "
                     f"{r['tokens_per_s']:>9.1f} {r['speedup_vs_ar']:>6.2f}x {r['worst_prompt_vs_ar']:>5.2f}x "
                     f"{r[ref]:>11.2f}x")
    for r in rows:
        if "tuning" in r:
            top = sorted(r["tuning"]["settings_used"].items(), key=lambda kv: -kv[1])[:4]
            lines.append(f"auto ({r['backend']}): rounds by setting " + ", ".join(f"{k} {v}" for k, v in top))
    if report.get("sweep"):
        sw = report["sweep"]
        lines.append(f"sweep: auto {sw['auto_tokens_per_s']:.1f} tok/s = {sw['auto_vs_best']:.2f}x the best grid point "
                     f"({sw['best']}, {sw['best_tokens_per_s']:.1f} tok/s); rank {sw['auto_rank']} of "
                     f"{sw['points'] + 1}")
    lines.append("vs ar: summed tokens/s against plain decoding's; worst: the slowest prompt's ratio")
    if any("worst_prompt_vs_ar_held_out" in r for r in rows):
        lines.append("worst, held out (the slowest prompt of the odd runs read on the even ones, and the reverse; "
                     "the lower): " + ", ".join(f"{r['setting']} {r['worst_prompt_vs_ar_held_out']:.2f}x"
                                                for r in rows if r["mode"] != "ar"))
    for backend, worst in report.get("plain_vs_itself_worst_prompt", {}).items():
        lines.append(f"plain decoding against itself ({backend}, odd runs against even ones): the slowest prompt "
                     f"{worst:.2f}x; a worst near it is the machine's noise")
    lines.append(f"greedy outputs identical across all rows: {report['identical_outputs']} "
                 f"({report['prompts']} prompts x {report['repeat']}, up to {report['max_new_tokens']} new tokens"
                 f"{', ending at end of turn' if report.get('stops_at_eos') else ''})")
    return "\n".join(lines + sixteen_bit_note(report))


if __name__ == "__main__":
    main()
