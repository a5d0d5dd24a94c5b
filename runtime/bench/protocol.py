"""The self-tuning tree's protocol on the default pair (``make bench-default``): what docs/results
records for it, in one command, each figure beside plain decoding's from the same run.

1. ``make demo``'s prompt: the default at first contact (an empty tuner cache) and again after it,
   plain decoding, and the eight fixed trees N = 8/16, M = 2/4, K = 4/8, each its own treeflash-run;
   ``--passes`` times over (the rows taking turns), each row's median reported.
2. The held-out sets (everyday chat, code, standard-library requests): ``treeflash-bench
   --heldout-prompts`` with the default, the fixed trees N = 8 and 16 of the default's family (M = 4,
   K = 8) and plain decoding, prompt by prompt, ``--heldout-runs`` times over (a prompt's ratio takes
   its runs together; plain decoding's second run against its first says how far noise alone moves a
   prompt's ratio).
3. In process, request slots at concurrency 1 and 8 (``treeflash-bench --concurrency 1,8``: 16 requests
   of ``--slot-tokens``, the default with its whole candidate set): the default, three hand tables and
   plain decoding (``--slot-runs`` runs of each, taking turns, each row the median run: a run of 16
   requests at concurrency 8 takes seconds, and this machine's speed moves by tens of percent between
   runs).

``--one-core`` runs every command on CPU 0 with one thread (``taskset -c 0``, OMP_NUM_THREADS=1),
which moves the ratios between a round's parts as another CPU would. Results go to OUT as JSON, and
a summary is printed last.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import click

PROMPT = "Write a Python function that checks whether a number is prime."
FIXED = [(n, m, k) for n in (8, 16) for m in (2, 4) for k in (4, 8)]
TABLES = "1:8;1:16,8:8;1:8,8:4"


def _bin(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def _run(cmd: list[str], env: dict, one_core: bool, log) -> dict:
    if one_core:
        cmd = ["taskset", "-c", "0", *cmd]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise click.ClickException(f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
    log(f"  {time.perf_counter() - t0:.0f} s: {' '.join(cmd[-12:])}")
    return json.loads(r.stdout.strip().splitlines()[-1])


@click.command()
@click.option("--out", default="artifacts/bench-default", type=click.Path(file_okay=False), show_default=True)
@click.option("--one-core", is_flag=True, help="Every command on CPU 0 with one thread.")
@click.option("--max-new-tokens", default=96, show_default=True)
@click.option("--heldout", default=10, show_default=True, help="Prompts per held-out set (0: skip the sets).")
@click.option("--slots/--no-slots", default=True, help="The request-slot rows.")
@click.option("--passes", default=2, show_default=True,
              help="Passes over the demo prompt's rows (each from an empty tuner cache); the summary takes the "
                   "median of each row's tokens/s.")
@click.option("--heldout-runs", default=2, show_default=True,
              help="Runs over each held-out set (a prompt's ratio takes its runs together; plain decoding's run 2 "
                   "against its run 1, prompt by prompt, shows how far a prompt's ratio moves by noise alone).")
@click.option("--slot-runs", default=3, show_default=True,
              help="Runs of each request-slot row (the rows taking turns); the summary takes the median run.")
@click.option("--slot-tokens", default=64, show_default=True,
              help="Tokens per request in the request-slot rows (treeflash-bench's default).")
def main(out, one_core, max_new_tokens, heldout, slots, passes, heldout_runs, slot_runs, slot_tokens):
    """Runs the protocol; prints a summary."""
    log = lambda m: click.echo(m, err=True)  # noqa: E731
    out = Path(out) / ("one-core" if one_core else "as-is")
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if one_core:
        env["OMP_NUM_THREADS"] = "1"
    from treeflash_export.smollm import cache_root

    def empty_cache() -> None:
        """An empty tuner cache: the converted default verifier is kept (converting it is not tuning)."""
        shutil.rmtree(cache, ignore_errors=True)
        cache.mkdir()
        for entry in cache_root().iterdir():
            if entry.name.startswith("smollm2"):
                shutil.copytree(entry, cache / entry.name)

    cache = out / "cache"
    env["TREEFLASH_CACHE"] = str(cache)
    run = [_bin("treeflash-run"), "--chat", "--prompt", PROMPT, "--max-new-tokens", str(max_new_tokens), "--json"]
    res: dict = {"one_core": one_core, "max_new_tokens": max_new_tokens, "passes": []}
    rows = {"auto first contact": [], "auto again": [], "ar": ["--mode", "ar"],
            **{f"treeflash N={n} M={m} K={k}": ["--mode", "treeflash", "--tree-size", str(n), "--top-m", str(m),
                                                "--top-k", str(k)] for n, m, k in FIXED}}
    for p in range(passes):  # the rows take turns: a machine whose speed drifts moves every row alike
        log(f"the demo prompt, pass {p + 1} of {passes}")
        empty_cache()
        res["passes"].append({name: _run(run + extra, env, one_core, log) for name, extra in rows.items()})
    res["demo"] = median_rows(res["passes"])
    bench = [_bin("treeflash-bench"), "--max-new-tokens", str(max_new_tokens), "--json"]
    res["heldout"] = {}
    for domain in ("chat-self", "code", "chat-stdlib") if heldout else ():
        log(f"held-out {domain}")
        res["heldout"][domain] = _run(bench + ["--heldout-prompts", str(heldout), "--heldout-domain", domain,
                                               "--repeat", str(heldout_runs),
                                               "--modes", "auto,treeflash", "--tree-sizes", "8,16", "--top-m", "4",
                                               "--top-k", "8"], env, one_core, log)
    if slots:
        log("request slots")
        # No --tree-sizes: it would size the deployment, and so the default's largest tree, to the tables'.
        res["slots"] = _run(bench[:1] + ["--concurrency", "1,8", "--requests", "16", "--max-new-tokens",
                                          str(slot_tokens), "--repeat", str(slot_runs), "--modes", "auto,treeflash",
                                          "--top-m", "4", "--top-k", "8", "--tree-size-by-batch", TABLES, "--json"],
                            env, one_core, log)
    (out / "protocol.json").write_text(json.dumps(res, indent=1))
    click.echo(summary(res))


def median_rows(passes: list[dict]) -> dict:
    """Each row of the first pass with the median tokens/s over the passes (and each pass's)."""
    out = {}
    for name, first in passes[0].items():
        rates = [p[name]["tokens_per_s"] for p in passes]
        out[name] = {**first, "tokens_per_s": statistics.median(rates), "tokens_per_s_by_pass": rates}
    return out


def held_out_ratios(passes: list[dict], row: str, fixed: list[str]) -> list[float]:
    """Per pass, ``row``'s tokens/s over that pass's rate of the fixed row that the other passes rank
    best (by their median). The best of several noisy rows' medians is biased up (the row that drew
    lucky passes wins); choosing on other passes and measuring on this one is not. Empty for one pass."""
    if len(passes) < 2:
        return []
    out = []
    for i, p in enumerate(passes):
        others = [q for j, q in enumerate(passes) if j != i]
        pick = max(fixed, key=lambda n: statistics.median(q[n]["tokens_per_s"] for q in others))
        out.append(p[row]["tokens_per_s"] / p[pick]["tokens_per_s"])
    return out


def summary(res: dict) -> str:
    lines = [f"profile: {'one core, one thread' if res['one_core'] else 'as is'}; {res['max_new_tokens']} new tokens"]
    demo = res["demo"]
    plain = demo["ar"]["tokens_per_s"]
    best_name = max((k for k in demo if k.startswith(("ar", "treeflash"))), key=lambda k: demo[k]["tokens_per_s"])
    best = demo[best_name]["tokens_per_s"]
    lines.append(f"demo prompt: plain {plain:.1f} tok/s; best fixed {best_name} {best:.1f} tok/s ({best / plain:.2f}x)")
    lines.append(f"  (median tokens/s of {len(res.get('passes', [])) or 1} passes; plain decoding by pass: "
                 f"{', '.join(f'{x:.1f}' for x in demo['ar'].get('tokens_per_s_by_pass', [plain]))})")
    passes = res.get("passes", [])
    fixed_rows = [k for k in demo if k.startswith(("ar", "treeflash"))]
    for k in ("auto first contact", "auto again"):
        t = demo[k]["tokens_per_s"]
        used = sorted(demo[k]["tuning"]["settings_used"].items(), key=lambda kv: -kv[1])[:3]
        lines.append(f"  {k}: {t:.1f} tok/s = {t / plain:.2f}x plain, {t / best:.2f}x the best; rounds {used}")
        held = held_out_ratios(passes, k, fixed_rows)
        if held:
            lines.append(f"    x the best fixed row chosen on the other passes: {statistics.median(held):.2f} "
                         f"(by pass {', '.join(f'{x:.2f}' for x in held)})")
    for k, v in demo.items():
        if k.startswith("treeflash"):
            lines.append(f"  {k}: {v['tokens_per_s']:.1f} tok/s ({v['tokens_per_s'] / plain:.2f}x)")
    for domain, rep in res.get("heldout", {}).items():
        rows = {r["setting"]: r for r in rep["rows"]}
        a = rows["auto"]
        fixed = "; ".join(f"{s} {r['speedup_vs_ar']:.2f}x (worst {r['worst_prompt_vs_ar']:.2f}x)"
                          for s, r in rows.items() if s.startswith("treeflash"))
        lines.append(f"held-out {domain}: auto {a['speedup_vs_ar']:.2f}x plain (worst prompt {a['worst_prompt_vs_ar']:.2f}x), "
                     f"{fixed}; outputs identical {rep['identical_outputs']}")
        if "worst_prompt_vs_ar_held_out" in a:
            lines.append(f"  auto's slowest prompt read held out (chosen on odd runs, read on even ones, and the "
                         f"reverse): {a['worst_prompt_vs_ar_held_out']:.2f}x")
        for worst in rep.get("plain_vs_itself_worst_prompt", {}).values():
            lines.append(f"  plain decoding against itself (odd runs against even ones): the slowest prompt "
                         f"{worst:.2f}x (a prompt's ratio moves this much by noise alone)")
    if "slots" in res:
        sl = res["slots"]
        if "requests" in sl:
            lines.append(f"request slots: {sl['requests']} requests of {sl['max_new_tokens']} tokens, the median of "
                         f"{sl.get('repeat', 1)} runs; outputs identical {sl.get('identical_outputs')}")
        for r in sl["rows"]:
            runs = r.get("ratio_to_ar_runs") if r.get("variant") != "ar" else None
            lines.append(f"slots {r.get('variant', ''):<24} c={r['concurrency']}: {r['tokens_per_s']:.1f} tok/s, "
                         f"{r.get('ratio_to_ar') or 1.0:.2f}x plain"
                         + (f" (run by run {min(runs):.2f}x to {max(runs):.2f}x)" if runs else ""))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
