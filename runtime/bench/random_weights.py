"""`treeflash-bench --random-weights PRESET`: round and step times at real shapes, no download.

One run builds a random-weight pair on the device (treeflash_export.presets), measures the
copy bandwidth, and times, side by side on the same runner: plain decoding steps and
rounds of chain / marginal / TreeFlash at each tree size, at each prompt length. Each
time is against its floor (the bytes of weights the pass reads over the bandwidth), and
a round is also turned into the speed-up it implies at an assumed number of tokens per
round: speed-up = tokens per round x plain step / round. Random weights accept almost
nothing, so tokens per round cannot be measured here; the real pair's figure comes from
treeflash-bench over checkpoints.

Floors (as in DESIGN section 6, the figures the issue's targets are written against): a plain
step reads the verifier's weights; a round reads the verifier, the drafter backbone, the LM
head once more on the drafter side and, in TreeFlash mode, the head. Two approximations:
embedding tables are counted whole, though a pass reads only its tokens' rows; and a TreeFlash
round reads the LM head twice on the drafter side (the marginal logits, then the expansion's
conditional logits, which need the marginal top-M first), counted once. With an untied
embedding of the LM head's size (Qwen3-8B) the two cancel in a TreeFlash round's floor, and a
plain step's floor is high by the embedding table (1.24 GB, about 0.42 ms at 3 TB/s), so its
ratio to the floor reads low. With tied embeddings (Qwen3-4B, counted once) a plain step's
floor is right and a TreeFlash round's is low by one LM head (0.78 GB), so its ratio reads high.
"""

from __future__ import annotations

import time
import warnings

import torch

from treeflash_export.config import SamplingConfig, TreeConfig
from treeflash_export.errors import ConfigError
from ..plan import RoundPlan

SPEC_MODES = ("chain", "marginal", "treeflash")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _configs(modes, tree_sizes, top_m, top_k, block) -> list[TreeConfig]:
    out = [TreeConfig(mode="ar").resolved(block)]
    for mode in modes:
        if mode == "ar":
            continue
        if mode not in SPEC_MODES:
            raise ConfigError(f"unknown mode {mode!r}; choose from {', '.join(SPEC_MODES + ('ar',))}")
        sizes = [block] if mode == "chain" else tree_sizes
        out += [TreeConfig(mode=mode, tree_size=n, top_m=top_m, top_k=top_k).resolved(block) for n in sizes]
    return out


def _time_rounds(runner, count: int) -> float:
    """Seconds per call of runner.round() (one step of begin's tree), which includes its one read-back."""
    _sync(runner.device)
    t0 = time.perf_counter()
    for _ in range(count):
        runner.round()
    _sync(runner.device)
    return (time.perf_counter() - t0) / count


def _host_syncs(runner) -> int | None:
    """Synchronising calls in one round, as CUDA's sync-debug mode reports them (CUDA only)."""
    if runner.device.type != "cuda":
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            runner.round()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def _stage_times(runner, tree: TreeConfig, count: int, log) -> tuple[dict[str, float], str]:
    """(milliseconds per stage, how): inside the captured round where graphs are on (CUDA events
    between the stages), else, or should that fail, eagerly, synchronised around each stage."""
    plan = RoundPlan(tree=tree)
    if runner.use_graphs:
        try:
            return runner.stage_times(plan, count), "in the CUDA graph"
        except RuntimeError as exc:  # keep the row: the eager breakdown still says where time goes
            log(f"  stage times in the graph failed ({str(exc).splitlines()[0]}); timing them eagerly")
    return runner.stage_times(plan, count, in_graph=False), "eager, synchronised"


def _time_setting(runner, prompt, tree: TreeConfig, rounds: int, warmup: int, stages: bool,
                  log) -> tuple[dict, float]:
    """One row: prefill, then rounds (or plain steps) of this setting timed on the runner; and the
    seconds its first begin spent beyond a plain prefill (graph capture with the kernels' first
    compilation, or torch.compile: a cold start's cost, which Triton's and Inductor's caches
    spare a second process)."""
    dev = runner.device
    t0 = time.perf_counter()
    runner.begin(prompt, tree, SamplingConfig())  # the first begin of a setting also captures its graphs
    _sync(dev)
    first_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    runner.begin(prompt, tree, SamplingConfig())
    _sync(dev)
    prefill_s = time.perf_counter() - t0
    for _ in range(warmup):
        runner.round()
    row = {"mode": tree.mode, "tree_size": tree.tree_size, "top_m": tree.top_m, "top_k": tree.top_k,
           "prompt_tokens": int(prompt.shape[0]), "ms_per_round": 1e3 * _time_rounds(runner, rounds),
           "prefill_ms": 1e3 * prefill_s, "host_syncs_per_round": _host_syncs(runner)}
    if stages:
        row["stages_ms"], row["stages_how"] = _stage_times(runner, tree, 5, log)
    return row, max(first_s - prefill_s, 0.0)


def run_random_bench(preset: str, *, modes, tree_sizes, prompt_lengths, rounds: int, warmup: int, top_m: int,
                     top_k: int, tokens_per_round: float, device: str, dtype: str, cuda_graphs: bool,
                     stages: bool, compile_steps: bool = False, fast_kernels: tuple[bool | None, ...] = (None,),
                     seed: int = 0, batch_sizes: tuple[int, ...] = (), log=None) -> dict:
    from treeflash_export.checkpoints import parse_dtype, pick_device
    from treeflash_export.presets import random_pair, weight_bytes
    from treeflash_kernels.bench import measure_bandwidth

    from ..backends.pytorch import TorchRunner

    log = log or (lambda msg: None)
    dev = torch.device(pick_device(device))
    torch_dtype = parse_dtype(dtype, dev)
    if rounds < 1 or warmup < 0 or not prompt_lengths or min(prompt_lengths) < 1:
        raise ConfigError("--rounds must be >= 1, --warmup >= 0 and every prompt length >= 1")
    t0 = time.perf_counter()
    verifier, drafter = random_pair(preset, device=dev, dtype=torch_dtype, seed=seed)
    _sync(dev)
    build_s = time.perf_counter() - t0
    log(f"random {preset} pair built on {dev} in {build_s:.1f}s")
    bw = measure_bandwidth(dev, 1 << 30 if dev.type == "cuda" else 1 << 27, 20 if dev.type == "cuda" else 5)

    block = drafter.cfg.block_size
    lm_head = verifier.lm_head.weight
    gb = {"verifier": weight_bytes(verifier), "drafter": weight_bytes(drafter.model),
          "head": weight_bytes(drafter.ar_approximation), "lm_head": lm_head.numel() * lm_head.element_size()}

    def floor_ms(mode: str) -> float:
        read = gb["verifier"]
        if mode != "ar":
            read += gb["drafter"] + gb["lm_head"] + (gb["head"] if mode == "treeflash" else 0)
        return 1e3 * read / bw

    configs = _configs(modes, tree_sizes, top_m, top_k, block)
    longest = max(c.tree_size for c in configs)
    capacity = max(prompt_lengths) + (warmup + rounds + 2 + (3 if stages else 0)) * block + longest
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, verifier.config.vocab_size, (plen,), generator=gen).to(dev) for plen in prompt_lengths]
    rows, capture_s, runner_s, failed, use_graphs = [], {}, {}, {}, False
    for kernels in fast_kernels:  # one runner per variant, over the same weights
        label = {True: "fast kernels", False: "torch ops", None: "auto"}[kernels]
        runner = None
        try:
            t0 = time.perf_counter()
            runner = TorchRunner(verifier, drafter, capacity=capacity, cuda_graphs=cuda_graphs,
                                 compile=compile_steps, fast_kernels=kernels, log=log)
            _sync(dev)
            use_graphs, kernels = runner.use_graphs, runner.fast_kernels
            label = "fast kernels" if kernels else "torch ops"
            runner_s[label] = time.perf_counter() - t0  # caches allocated, projections merged
            capture_s[label] = 0.0
            for prompt in prompts:
                ar_ms = None
                for tree in configs:
                    row, capture = _time_setting(runner, prompt, tree, rounds, warmup, stages and not compile_steps,
                                                 log)
                    capture_s[label] += capture
                    row.update(fast_kernels=kernels, floor_ms=floor_ms(tree.mode), capture_s=capture)
                    row["ratio_to_floor"] = row["ms_per_round"] / row["floor_ms"]
                    if tree.mode == "ar":
                        ar_ms = row["ms_per_round"]
                    row["ratio_to_ar"] = row["ms_per_round"] / ar_ms
                    row["implied_speedup"] = (tokens_per_round * ar_ms / row["ms_per_round"] if tree.mode != "ar"
                                              else 1.0)
                    rows.append(row)
                    log(f"  {label} P={row['prompt_tokens']} {tree.mode} N={tree.tree_size}: "
                        f"{row['ms_per_round']:.2f} ms")
        except Exception as exc:  # comparing paths: one failing (a kernel new to a device) keeps the other's rows
            if len(fast_kernels) == 1:
                raise
            failed[label] = f"{type(exc).__name__}: {exc}"[:2000]
            log(f"  {label} failed: {failed[label].splitlines()[0]}")
        finally:
            del runner
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    batch_rows = []
    if batch_sizes:
        try:
            batch_rows = _time_batches(verifier, drafter, configs, sorted(set(batch_sizes)), prompts[0], rounds, warmup,
                                       capacity, cuda_graphs, fast_kernels[0], log)
        except Exception as exc:  # noqa: BLE001 the single-sequence rows above stay
            failed["batched"] = f"{type(exc).__name__}: {exc}"[:2000]
            log(f"  batched rows failed: {failed['batched'].splitlines()[0]}")
    short = min(prompt_lengths)
    by = {(r["fast_kernels"], r["mode"], r["tree_size"], r["prompt_tokens"]): r for r in rows}
    for r in rows:
        base = by.get((r["fast_kernels"], r["mode"], r["tree_size"], short))
        r["ratio_to_shortest_prompt"] = r["ms_per_round"] / base["ms_per_round"] if base else None
    return {
        "preset": preset, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "dtype": str(torch_dtype).replace("torch.", ""), "cuda_graphs": use_graphs, "compiled": compile_steps,
        "bandwidth_gbps": bw / 1e9, "weights_gb": {k: v / 1e9 for k, v in gb.items()},
        "floor_ms": floor_ms("ar"), "tokens_per_round_assumed": tokens_per_round, "rounds_timed": rounds,
        "startup_s": {"build_pair": build_s, "runner": runner_s, "capture_graphs": capture_s}, "rows": rows,
        "batch_rows": batch_rows, "failed": failed,
    }


def _time_batches(verifier, drafter, configs, batch_sizes, prompt, rounds, warmup, capacity, cuda_graphs,
                  fast_kernels, log) -> list[dict]:
    """Round time of the request-slot runner (in-flight batching) at each batch size and tree setting:
    b slots all running the same prompt, rounds timed after warm-up; against its own batch of one."""
    from ..backends.pytorch import TorchRunner

    out = []
    for tree in configs:
        base = None
        for b in batch_sizes:
            runner = TorchRunner(verifier, drafter, max_batch=b, capacity=capacity, tree=tree, cuda_graphs=cuda_graphs, capture_at_start=False,
                                fast_kernels=fast_kernels, log=log)
            for slot in range(b):
                runner.admit(slot, SamplingConfig())
                runner.prefill(slot, prompt, last=True)
            plan = RoundPlan(tree=runner.deployment[b])
            for _ in range(warmup + 1):  # the first also captures the bucket's round
                runner.step(plan)
            _sync(runner.device)
            t0 = time.perf_counter()
            for _ in range(rounds):
                runner.step(plan)
            _sync(runner.device)
            ms = 1e3 * (time.perf_counter() - t0) / rounds
            base = base or ms
            out.append({"batch": b, "mode": tree.mode, "tree_size": tree.tree_size, "nodes": b * tree.tree_size,
                        "prompt_tokens": int(prompt.shape[0]), "ms_per_round": ms, "ratio_to_batch_1": ms / base,
                        "fast_kernels": runner.fast_kernels})
            log(f"  batch {b} {tree.mode} N={tree.tree_size}: {ms:.2f} ms per round")
            del runner
            if prompt.is_cuda:
                torch.cuda.empty_cache()
    return out


def format_random_report(rep: dict) -> str:
    w = rep["weights_gb"]
    lines = [
        f"random {rep['preset']} pair on {rep['device']} ({rep['dtype']}, CUDA graphs {'on' if rep['cuda_graphs'] else 'off'}"
        f", {'compiled' if rep['compiled'] else 'eager kernels'})",
        f"copy bandwidth {rep['bandwidth_gbps']:.0f} GB/s; weights: verifier {w['verifier']:.3f} GB, drafter "
        f"{w['drafter']:.3f} GB, head {w['head']:.3f} GB, LM head {w['lm_head']:.3f} GB; "
        f"plain-step floor {rep['floor_ms']:.3f} ms",
        f"start-up: pair built in {rep['startup_s']['build_pair']:.1f}s, runners made in "
        + ", ".join(f"{v:.1f}s ({k})" for k, v in rep["startup_s"]["runner"].items())
        + ", graphs captured in "
        + ", ".join(f"{v:.1f}s ({k})" for k, v in rep["startup_s"]["capture_graphs"].items())
        + f"; implied speed-up at {rep['tokens_per_round_assumed']:g} tokens/round (assumed)",
    ]
    head = (f"{'path':<8} {'prompt':>6} {'mode':<10} {'N':>4} {'ms/round':>9} {'floor':>8} {'x floor':>8} "
            f"{'x ar':>6} {'speed-up':>9} {'x short':>8} {'syncs':>5}")
    lines += [head, "-" * len(head)]
    for r in rep["rows"]:
        syncs = "-" if r["host_syncs_per_round"] is None else str(r["host_syncs_per_round"])
        short = "-" if r["ratio_to_shortest_prompt"] is None else f"{r['ratio_to_shortest_prompt']:.2f}x"
        lines.append(f"{'kernels' if r['fast_kernels'] else 'torch':<8} {r['prompt_tokens']:>6} {r['mode']:<10} "
                     f"{r['tree_size']:>4} {r['ms_per_round']:>9.3f} {r['floor_ms']:>8.3f} {r['ratio_to_floor']:>7.2f}x "
                     f"{r['ratio_to_ar']:>5.2f}x {r['implied_speedup']:>8.2f}x {short:>8} {syncs:>5}")
        if "stages_ms" in r:
            lines.append(f"         stages ({r['stages_how']}): " +
                         ", ".join(f"{k} {v:.2f} ms" for k, v in r["stages_ms"].items()))
    if rep.get("batch_rows"):
        head = f"{'batch':>5} {'mode':<10} {'N':>4} {'nodes':>6} {'ms/round':>9} {'x batch 1':>9}"
        lines += ["", "request slots (in-flight batching), prompt "
                  f"{rep['batch_rows'][0]['prompt_tokens']}:", head, "-" * len(head)]
        lines += [f"{r['batch']:>5} {r['mode']:<10} {r['tree_size']:>4} {r['nodes']:>6} {r['ms_per_round']:>9.3f} "
                  f"{r['ratio_to_batch_1']:>8.2f}x" for r in rep["batch_rows"]]
    lines += [f"FAILED ({label}): {msg}" for label, msg in rep.get("failed", {}).items()]
    return "\n".join(lines)
