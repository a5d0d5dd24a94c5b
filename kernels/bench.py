"""`treeflash-kernel-bench`: the MLP expansion, Triton kernels vs the eager PyTorch composition,
side by side in one run, against the floor set by reading the head's weights at the memory
bandwidth measured on the same device in the same run.

Implementations:
  eager          the plain PyTorch reference (what the PyTorch backend runs without the op)
  triton         all four Triton kernels
  triton-cublas  the two row-wise Triton kernels, the GEMMs through torch.matmul (cuBLAS)
Each is timed as the median of --repeat calls after --warmup calls (CUDA events on a GPU),
and checked against eager for agreement.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import click
import torch

from . import mlp_expand as mk

IMPLS = ("eager", "triton", "triton-cublas")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def parse_tiles(text: str) -> list[mk.GemmTiles]:
    """'64x64x64x4x3,128x64x64x8x3' -> GemmTiles(block_m, block_n, block_k, num_warps, num_stages) each."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        nums = [int(x) for x in part.split("x")]
        if len(nums) != 5:
            raise click.BadParameter(f"{part!r}: expected BMxBNxBKxWARPSxSTAGES")
        out.append(mk.GemmTiles(*nums))
    return out


def _timer(device: torch.device):
    if device.type == "cuda":
        def run(fn, repeat):
            times = []
            for _ in range(repeat):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) / 1e3)
            return statistics.median(times)
    else:
        def run(fn, repeat):
            times = []
            for _ in range(repeat):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            return statistics.median(times)
    return run


def measure_bandwidth(device: torch.device, nbytes: int, repeat: int) -> float:
    """Bytes per second of a device-to-device copy (read + write counted)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = _timer(device)(lambda: dst.copy_(src), repeat)
    return 2 * src.numel() * 4 / seconds


def make_problem(B, M, H, I, V, dtype, device, seed=0, norm_eps=1e-6):
    """Random inputs of mlp_expand in its argument order, weights scaled like trained ones."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def r(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=g) * scale + shift).to(device=device, dtype=dtype)

    ids = torch.randint(0, V, (B - 1, M), generator=g).to(device)
    return (r(B, H, scale=3.0), ids, r(V, H), r(H, scale=0.1, shift=1.0), r(2 * I, 2 * H, scale=H ** -0.5),
            r(2 * I, scale=0.02), r(H, I, scale=I ** -0.5), r(H, scale=0.1, shift=1.0), 1e-6, norm_eps)


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--hidden", "H", type=int, default=4096, help="H (Qwen3-8B: 4096).")
@click.option("--intermediate", "I", type=int, default=12288, help="I of the head (Qwen3-8B: 12288).")
@click.option("--block", "B", type=int, default=16, help="Block size B (rows: (B-1) * M).")
@click.option("--top-m", "M", type=int, default=16, help="Parent candidates per position.")
@click.option("--vocab", "V", type=int, default=151936, help="Embedding rows (only M rows per position are read).")
@click.option("--dtype", type=click.Choice(list(DTYPES)), default="bfloat16")
@click.option("--device", default="auto", help="cuda, cpu or auto.")
@click.option("--impls", default=",".join(IMPLS), help=f"Comma-separated subset of {', '.join(IMPLS)}.")
@click.option("--tiles", default=None, help="Triton GEMM tiles to sweep, BMxBNxBKxWARPSxSTAGES,... "
              "(the fastest is reported) [default: the built-in tiles]")
@click.option("--repeat", type=int, default=50)
@click.option("--warmup", type=int, default=10)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the table.")
def main(H, I, B, M, V, dtype, device, impls, tiles, repeat, warmup, as_json):
    """Time the MLP expansion at one shape: Triton kernels vs eager PyTorch vs the weight-reading floor."""
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    wanted = [x.strip() for x in impls.split(",") if x.strip()]
    bad = [x for x in wanted if x not in IMPLS]
    if bad:
        raise click.UsageError(f"unknown --impls {', '.join(bad)}; choose from {', '.join(IMPLS)}")
    if any(x != "eager" for x in wanted):
        if mk.triton is None:
            raise click.UsageError("the Triton implementations need triton: pip install triton")
        if dev.type == "cpu" and not mk.interpreting():
            raise click.UsageError("Triton kernels on a CPU run only in Triton's interpreter: set TRITON_INTERPRET=1 "
                                   "(and use tiny shapes, e.g. --hidden 64 --intermediate 96), or use a GPU")
        if dev.type == "cpu" and H * I > 1 << 16:
            raise click.UsageError(f"H x I = {H * I} is too large for Triton's interpreter (about 10^4 times slower "
                                   "than compiled code): use --hidden 64 --intermediate 96, or a GPU")
    tile_list = parse_tiles(tiles) if tiles else [mk.DEFAULT_TILES]
    torch_dtype = DTYPES[dtype]
    args = make_problem(B, M, H, I, V, torch_dtype, dev)
    R = (B - 1) * M
    elt = torch.finfo(torch_dtype).bits // 8
    weight_bytes = (2 * I * 2 * H + 2 * I + H * I + 2 * H) * elt + R * H * elt  # head weights + gathered rows
    time_fn = _timer(dev)
    bw = measure_bandwidth(dev, min(1 << 30, max(64 << 20, 4 * weight_bytes)) if dev.type == "cuda" else 64 << 20,
                           max(5, repeat // 5))
    floor_s = weight_bytes / bw

    impl_fns = {
        "eager": lambda t: (lambda: mk.mlp_expand_reference(*args)),
        "triton": lambda t: (lambda: mk.mlp_expand_triton(*args, gemm="triton", tiles=t)),
        "triton-cublas": lambda t: (lambda: mk.mlp_expand_triton(*args, gemm="torch")),
    }
    reference = mk.mlp_expand_reference(*args).float()
    rows = []
    for name in wanted:
        best = None
        for t in (tile_list if name == "triton" else [None]):
            fn = impl_fns[name](t)
            with torch.no_grad():
                out = fn()
                err = (out.float() - reference).abs().max().item()
                for _ in range(warmup):
                    fn()
                s = time_fn(fn, repeat)
            if best is None or s < best["seconds"]:
                best = {"impl": name, "seconds": s, "max_abs_diff_vs_eager": err,
                        "tiles": None if t is None else t.__dict__}
        rows.append(best)
    eager_s = next((r["seconds"] for r in rows if r["impl"] == "eager"), None)
    for r in rows:
        r["speedup_vs_eager"] = eager_s / r["seconds"] if eager_s else None
        r["x_floor"] = r["seconds"] / floor_s
    report = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "shape": {"B": B, "M": M, "rows": R, "H": H, "I": I, "V": V, "dtype": dtype},
        "bandwidth_GBps": bw / 1e9, "weight_bytes": weight_bytes, "floor_ms": floor_s * 1e3,
        "triton_interpreter": bool(mk.triton is not None and mk.interpreting()),
        "results": rows,
    }
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    click.echo(f"device {report['device']}  rows {R} = ({B}-1) x {M}  H {H}  I {I}  {dtype}")
    click.echo(f"measured copy bandwidth {bw / 1e9:.1f} GB/s; head weights {weight_bytes / 1e6:.1f} MB "
               f"-> floor {floor_s * 1e3:.4f} ms")
    if report["triton_interpreter"]:
        click.echo("note: Triton's interpreter (TRITON_INTERPRET=1): these timings say nothing about GPU speed")
    click.echo(f"{'impl':<15}{'ms':>10}{'vs eager':>10}{'x floor':>10}{'max |diff|':>12}  tiles")
    for r in rows:
        tiles_txt = "x".join(str(v) for v in r["tiles"].values()) if r["tiles"] else ""
        vs = f"{r['speedup_vs_eager']:.2f}x" if r["speedup_vs_eager"] else "-"
        click.echo(f"{r['impl']:<15}{r['seconds'] * 1e3:>10.4f}{vs:>10}{r['x_floor']:>9.2f}x"
                   f"{r['max_abs_diff_vs_eager']:>12.2e}  {tiles_txt}")


if __name__ == "__main__":
    sys.exit(main())
