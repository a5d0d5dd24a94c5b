"""`treeflash-bench --concurrency 1,4,8 --requests R`: the same R distinct prompts served in process
through the in-flight batching engine at each concurrency (C clients, each sending its next request
when its last one ends), side by side in one run.

Per row: aggregate tokens per second over the row's wall time; per request, time to first token
(submission -> first token) and inter-token latency (first -> last token over the tokens after the
first), as mean/p50/p90; tokens per round; and whether every request's tokens equal its tokens at
concurrency 1 (greedy: they must).
"""

from __future__ import annotations

import time

import numpy as np

from treeflash_export.config import SamplingConfig
from treeflash_export.errors import TreeFlashError


def summary_ms(values: list[float]) -> dict:
    a = np.asarray(values, dtype=np.float64) * 1e3
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90))}


def serve_closed_loop(engine, prompts: list[list[int]], sampling: SamplingConfig, concurrency: int):
    """Serves every prompt with at most `concurrency` in flight; returns (requests, wall seconds)."""
    from ..engine import Request

    requests = [Request(ids, sampling) for ids in prompts]
    queue = iter(requests)

    def next_one(_=None):
        request = next(queue, None)
        if request is not None:
            request.on_done = next_one
            request.submitted_at = time.perf_counter()
            engine.submit(request)

    t0 = time.perf_counter()
    for _ in range(concurrency):
        next_one()
    engine.drain(requests)
    return requests, time.perf_counter() - t0


def batching_row(requests, wall_s: float, concurrency: int, reference) -> dict:
    ttft = [r.first_token_at - r.submitted_at for r in requests]
    itl = [(r.token_times[-1] - r.token_times[0]) / (len(r.tokens) - 1) for r in requests if len(r.tokens) > 1]
    lengths = [n for r in requests for n in r.accept_lengths]
    tokens = sum(len(r.tokens) for r in requests)
    return {"where": "in_process", "concurrency": concurrency, "requests": len(requests), "tokens": tokens,
            "tokens_per_s": tokens / wall_s, "ttft_ms": summary_ms(ttft), "itl_ms": summary_ms(itl or [0.0]),
            "tokens_per_round": sum(lengths) / len(lengths) if lengths else 0.0,
            "identical_outputs": reference is None or all(r.tokens == ref for r, ref in zip(requests, reference))}


def run_batching_bench(sess, prompts: list[list[int]], concurrency: list[int], max_new_tokens: int,
                       stop_token_ids=(), variants: list[tuple] | None = None, repeat: int = 1) -> dict:
    """Serves the prompts through the engine at each concurrency, for each variant in turn on one
    runner: (label, deployment tree, tree size by batch, tuner or None); default: the runner's own tree.
    Outputs are compared with the first variant's first row (greedy: they must be identical).
    repeat > 1: every variant and concurrency runs that many times, the variants taking turns (a
    machine that slows down or speeds up during the run then touches them all alike), and each row
    is the run with the median tokens/s, with every run's tokens/s beside it (and its ratio to plain
    decoding's run of the same turn: the ratios' spread is what noise moves a row by)."""
    from ..engine import Engine, fixed_plans

    if not concurrency or min(concurrency) < 1:
        raise TreeFlashError("--concurrency takes batch sizes >= 1, e.g. 1,4,8")
    if repeat < 1:
        raise TreeFlashError("--repeat must be >= 1")
    runner = sess.runner
    if variants is None:
        variants = [(runner.deployment[1].mode, None, None, sess.tuner)]
    sampling = SamplingConfig(max_new_tokens=max_new_tokens, stop_token_ids=tuple(stop_token_ids))
    runs: dict[tuple[int, int], list[dict]] = {}  # (variant index, concurrency) -> its rows
    reference = None
    for turn in range(repeat):
        for i, (label, tree, table, tuner) in enumerate(variants):
            policy = tuner if tuner is not None or tree is None else fixed_plans(runner, tree, table)
            if turn == 0:
                engine = Engine(runner, policy=policy)
                serve_closed_loop(engine, prompts[:1], sampling, 1)  # warm-up (and the tuner's first rounds)
                engine.close()
            for c in sorted(set(concurrency)):
                engine = Engine(runner, max_active=c, policy=policy)
                requests, wall = serve_closed_loop(engine, prompts, sampling, c)
                engine.close()
                row = batching_row(requests, wall, c, reference)
                row["variant"] = label
                if tuner is not None:
                    row["tuning"] = tuner.report()
                runs.setdefault((i, c), []).append(row)
                if reference is None:
                    reference = [r.tokens for r in requests]
    rows = []
    for done in runs.values():  # in variant, then concurrency order
        row = sorted(done, key=lambda r: r["tokens_per_s"])[(len(done) - 1) // 2]
        row["identical_outputs"] = all(r["identical_outputs"] for r in done)
        if repeat > 1:
            row["tokens_per_s_runs"] = [r["tokens_per_s"] for r in done]
        rows.append(row)
    for row in rows:
        first = next(r for r in rows if r["variant"] == row["variant"])
        row["ratio_to_first"] = row["tokens_per_s"] / first["tokens_per_s"]
        plain = next((r for r in rows if r["variant"] == "ar" and r["concurrency"] == row["concurrency"]), None)
        row["ratio_to_ar"] = row["tokens_per_s"] / plain["tokens_per_s"] if plain else None
        if plain and repeat > 1:  # each run against plain decoding's run of the same turn: the spread
            row["ratio_to_ar_runs"] = [a / p for a, p in zip(row["tokens_per_s_runs"], plain["tokens_per_s_runs"])]
    return {"rows": rows, "identical_outputs": all(r["identical_outputs"] for r in rows), "requests": len(prompts),
            "max_new_tokens": max_new_tokens, "variants": [v[0] for v in variants], "repeat": repeat,
            "device": str(runner.device), "dtype": str(runner.dtype).replace("torch.", ""),
            "max_batch": runner.max_batch}


def latency_cells(row: dict) -> tuple[str, str]:
    """A row's TTFT and ITL as 'mean/p50/p90' text (milliseconds)."""
    t, i = row["ttft_ms"], row["itl_ms"]
    return f"{t['mean']:.1f}/{t['p50']:.1f}/{t['p90']:.1f}", f"{i['mean']:.2f}/{i['p50']:.2f}/{i['p90']:.2f}"


def format_batching_report(report: dict) -> str:
    head = (f"{'variant':<22} {'conc':>4} {'reqs':>4} {'tok/s':>8} {'x c=' + str(report['rows'][0]['concurrency']):>6} "
            f"{'x ar':>5} {'TTFT mean/p50/p90 ms':>22} {'ITL mean/p50/p90 ms':>21} {'tok/round':>9} {'same':>5}")
    lines = [head, "-" * len(head)]
    for r in report["rows"]:
        ttft, itl = latency_cells(r)
        vs_ar = "-" if r.get("ratio_to_ar") is None else f"{r['ratio_to_ar']:.2f}"
        lines.append(f"{r.get('variant', ''):<22} {r['concurrency']:>4} {r['requests']:>4} {r['tokens_per_s']:>8.1f} "
                     f"{r['ratio_to_first']:>6.2f} {vs_ar:>5} {ttft:>22} {itl:>21} {r['tokens_per_round']:>9.2f} "
                     f"{str(r['identical_outputs']):>5}")
    for r in report["rows"]:
        if "tuning" in r:
            picks = ", ".join(f"{b}: {c['mode']}" + (f" N={c['tree_size']}" if c["mode"] not in ("ar", "chain") else "")
                              for b, c in r["tuning"]["choices"].items())
            lines.append(f"auto at concurrency {r['concurrency']}: last choice per slot bucket {picks}")
    runs = report.get("repeat", 1)
    lines.append(f"{report['requests']} requests of {report['max_new_tokens']} new tokens on {report['device']}; "
                 + (f"each row the median of {runs} runs, the variants taking turns; " if runs > 1 else "")
                 + f"outputs identical to the first row: {report['identical_outputs']}")
    lines += sixteen_bit_note(report)
    return "\n".join(lines)


def sixteen_bit_note(report: dict) -> list[str]:
    """Why outputs that differ may still be right: in 16-bit a batch shape or a tree size changes the
    rounding (seen on an H200 with random bf16 weights: every row after the first differed)."""
    if report["identical_outputs"] or report.get("dtype") not in ("bfloat16", "float16"):
        return []
    return ["  (in 16-bit a batch shape or tree size changes the rounding, which can flip near-tied greedy "
            "tokens; exactness is checked in float32)"]


def run_slot_cost_bench(make_runner, capacities: list[int], prompt: list[int], repeat: int = 5) -> dict:
    """`treeflash-bench --slot-costs 2048,16384`: what admitting, prefilling and releasing a short request
    costs at each cache capacity per slot (a runner of two slots per capacity, from ``make_runner``):
    slot 0 holds a request, slot 1 takes the prompt, then slot 0 leaves (slot 1 moves into it). Both
    costs must follow the request, not the capacity; medians of ``repeat`` runs, milliseconds."""
    import torch

    from treeflash_export.config import SamplingConfig as Sampling

    rows = []
    for capacity in capacities:
        runner = make_runner(capacity)
        ids = torch.tensor(prompt, dtype=torch.long, device=runner.device)
        prefill, release = [], []
        for i in range(repeat + 1):  # the first run warms up
            runner.admit(0, Sampling())
            runner.prefill(0, ids, last=True)
            t0 = time.perf_counter()
            runner.admit(1, Sampling())
            runner.prefill(1, ids, last=True)
            t1 = time.perf_counter()
            runner.release(0)
            if runner.device.type == "cuda":
                torch.cuda.synchronize(runner.device)
            t2 = time.perf_counter()
            runner.release(0)
            if i:
                prefill.append(t1 - t0)
                release.append(t2 - t1)
        rows.append({"capacity": capacity, "prefill_ms": 1e3 * float(np.median(prefill)),
                     "release_ms": 1e3 * float(np.median(release)), "prompt_tokens": len(prompt)})
        del runner
    for row in rows:
        row["prefill_ratio"] = row["prefill_ms"] / rows[0]["prefill_ms"]
        row["release_ratio"] = row["release_ms"] / rows[0]["release_ms"]
    return {"rows": rows, "repeat": repeat}


def format_slot_cost_report(report: dict) -> str:
    head = f"{'capacity':>9} {'prompt':>6} {'prefill ms':>10} {'x first':>7} {'release ms':>10} {'x first':>7}"
    lines = [head, "-" * len(head)]
    lines += [f"{r['capacity']:>9} {r['prompt_tokens']:>6} {r['prefill_ms']:>10.2f} {r['prefill_ratio']:>6.2f}x "
              f"{r['release_ms']:>10.3f} {r['release_ratio']:>6.2f}x" for r in report["rows"]]
    lines.append(f"a short request's prefill and release per cache capacity per slot (median of {report['repeat']})")
    return "\n".join(lines)
