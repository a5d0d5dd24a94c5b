"""`treeflash-export build`: checkpoints -> ONNX graphs (-> engines) -> one artifact folder.

The folder is assembled in a hidden temporary sibling and renamed into place at
the end, with the manifest written last, so an interrupted or failed build never
leaves anything that looks complete.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from .. import __version__
from .artifact import FORMAT, FORMAT_VERSION, MANIFEST, file_table
from ..config import TreeConfig
from .engines import ENGINE_SUFFIX, build_engine, trt_version
from ..errors import ConfigError, TreeFlashError
from ..fsutil import atomic_folder
from .graphs import DraftGraph, ExpandGraph, GraphSpec, Shapes, VerifyGraph, graph_specs
from ..models import TreeVerifier

TARGETS = ("onnx", "tensorrt", "tensorrt-rtx")
VARIANTS = ("reference", "plugin")  # plugin: the TreeFlash head as one treeflash.MlpExpand node
GRAPHS = ("verify", "draft", "expand")
# Max |ONNX Runtime - eager| accepted per output dtype of the fp32 build (seen: about 1e-6).
TOLERANCE = {"float32": 1e-3, "float16": 5e-2, "bfloat16": 2e-1}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "vocab.json", "merges.txt", "tokenizer.model", "generation_config.json")


@dataclass(frozen=True)
class BuildConfig:
    mode: str = "treeflash"
    tree_size: int = 64
    top_m: int = 16
    top_k: int = 16
    drafter_temperature: float = 1.0
    dtype: str = "float32"
    max_seq_len: int = 2048
    prefill_chunk: int = 64
    target: str = "onnx"
    variant: str = "reference"
    opset: int = 18

    def tree(self) -> TreeConfig:
        return TreeConfig(self.mode, self.tree_size, self.top_m, self.top_k, self.drafter_temperature)

    def validate(self) -> None:
        if self.mode == "ar":
            raise ConfigError("--mode ar needs no export: plain decoding uses the verify graph of any build")
        if self.target not in TARGETS:
            raise ConfigError(f"unknown --target {self.target!r}; choose one of {', '.join(TARGETS)}")
        if self.variant not in VARIANTS:
            raise ConfigError(f"unknown --variant {self.variant!r}; choose one of {', '.join(VARIANTS)}")
        if self.variant == "plugin" and self.mode != "treeflash":
            raise ConfigError(f"--variant plugin replaces the TreeFlash head, which --mode {self.mode} does not "
                              f"use: build --variant reference")
        if self.variant == "plugin" and self.target == "tensorrt-rtx":
            raise ConfigError("TensorRT-RTX has no plugin API: build --variant reference for --target tensorrt-rtx")
        if self.dtype not in ("float32", "float16", "bfloat16"):
            raise ConfigError(f"unknown --dtype {self.dtype!r}")
        if self.prefill_chunk < 1:
            raise ConfigError(f"--prefill-chunk must be >= 1, got {self.prefill_chunk}")
        if self.max_seq_len < self.tree_size + 2:
            raise ConfigError(f"--max-seq-len {self.max_seq_len} leaves no room for a prompt and a tree "
                              f"of {self.tree_size} nodes")


def _shapes(verifier: TreeVerifier, dcfg, tree: TreeConfig, cfg: BuildConfig) -> Shapes:
    return Shapes(
        vocab=verifier.vocab_size, hidden=verifier.hidden_size,
        features=len(dcfg.target_layer_ids) * verifier.hidden_size,
        layers=verifier.num_layers, kv_heads=verifier.num_kv_heads, head_dim=verifier.head_dim,
        draft_layers=dcfg.num_layers, draft_kv_heads=dcfg.num_kv_heads, draft_head_dim=dcfg.head_dim,
        block=dcfg.block_size, tree=tree.tree_size, top_m=tree.top_m, top_k=tree.top_k,
        capacity=cfg.max_seq_len, max_tokens=max(cfg.prefill_chunk, tree.tree_size),
        mask_token_id=dcfg.mask_token_id,
    )


def example_inputs(name: str, sh: Shapes, dtype: torch.dtype, seed: int, n: int | None = None):
    """Valid inputs for a graph (random values, real masks), for tracing and for parity checks."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    if name == "verify":
        n = n or sh.tree
        past = sh.capacity // 3
        idx = torch.arange(n)
        parents = torch.clamp(idx - 1 - torch.randint(0, 2, (n,), generator=g), min=0)  # a random tree
        parents[0] = -1
        from ..tree import ancestor_mask

        mask = ancestor_mask(parents, n)
        depth = mask.sum(-1) - 1
        return (torch.randint(0, sh.vocab, (n,), generator=g), past + depth, mask, torch.tensor([past]),
                rand(sh.layers, 2, sh.kv_heads, sh.capacity, sh.head_dim))
    if name == "draft":
        return (torch.tensor([int(torch.randint(0, sh.vocab, (1,), generator=g))]), rand(sh.block, sh.features),
                torch.tensor([sh.capacity // 3]), torch.tensor([max(1, sh.block - 3)]),
                rand(sh.draft_layers, 2, sh.draft_kv_heads, sh.capacity, sh.draft_head_dim))
    if name == "expand":
        return rand(sh.block, sh.hidden) * 4, torch.tensor([int(torch.randint(0, sh.vocab, (1,), generator=g))])
    raise KeyError(name)


def graph_modules(pair, tree: TreeConfig, variant: str = "reference"):
    verifier = TreeVerifier(pair.verifier, pair.drafter_cfg.target_layer_ids)
    d, cfg = pair.drafter, pair.drafter_cfg
    return verifier, {
        "verify": VerifyGraph(verifier).eval(),
        "draft": DraftGraph(d.model, verifier.embed_tokens, cfg.block_size, cfg.mask_token_id).eval(),
        "expand": ExpandGraph(d.model.norm, verifier.lm_head, verifier.embed_tokens, d.ar_approximation, tree,
                              fused=variant == "plugin").eval(),
    }


def export_onnx(module, spec: GraphSpec, inputs, path: Path, opset: int, custom_ops: bool = False) -> None:
    """custom_ops: translate TreeFlash's custom op into its treeflash.MlpExpand node."""
    from treeflash_plugins.onnx_ops import translation_table

    import logging
    import warnings

    logging.getLogger("torch.onnx").setLevel(logging.ERROR)  # e.g. "torchvision is not installed"

    dims = {}
    dynamic = {}
    for s in spec.inputs:
        axes = {i: dims.setdefault(d, torch.export.Dim(d, min=spec.dynamic[d][0], max=spec.dynamic[d][2]))
                for i, d in enumerate(s.shape) if isinstance(d, str)}
        dynamic[s.name] = axes or None
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            # optimize: constant folding, so TensorRT's parser sees e.g. ReduceMean axes as constants
            # (torch 2.13's default; torch 2.6, which pyproject.toml allows, leaves it off)
            module, inputs, dynamo=True, optimize=True, opset_version=opset, verbose=False,
            input_names=[s.name for s in spec.inputs], output_names=[s.name for s in spec.outputs],
            dynamic_shapes=dynamic if dims else None,
            custom_translation_table=translation_table() if custom_ops else None,
        )
    big = sum(p.numel() * p.element_size() for p in module.parameters()) > (1 << 30)
    program.save(str(path), external_data=big)


def onnx_weight_bytes(path: Path) -> int:
    import onnx
    from onnx import helper

    model = onnx.load(str(path), load_external_data=False)
    total = 0
    for init in model.graph.initializer:
        n = 1
        for d in init.dims:
            n *= d
        total += n * helper.tensor_dtype_to_np_dtype(init.data_type).itemsize  # bfloat16 included
    return total


def parity(module, spec: GraphSpec, path: Path, inputs_list, dtype: str) -> dict:
    """Max |ONNX Runtime - eager| per output over several inputs."""
    import numpy as np
    from treeflash_plugins.onnx_ops import ort_session

    sess = ort_session(path)
    worst = {s.name: 0.0 for s in spec.outputs}
    for inputs in inputs_list:
        with torch.no_grad():
            ref = module(*inputs)
        feeds = {s.name: t.numpy() for s, t in zip(spec.inputs, inputs)}
        spec.check_inputs(feeds)
        outs = sess.run([s.name for s in spec.outputs], feeds)
        for s, o, r in zip(spec.outputs, outs, ref):
            r = r.float().numpy() if r.is_floating_point() else r.numpy()
            diff = float(np.abs(o.astype(np.float64) - r.astype(np.float64)).max()) if o.size else 0.0
            worst[s.name] = max(worst[s.name], diff)
    return {name: {"max_abs_diff": d, "tolerance": TOLERANCE[dtype], "ok": d <= TOLERANCE[dtype]}
            for name, d in worst.items()}


def _versions(target: str) -> dict:
    import importlib.metadata as md

    out = {"treeflash_export": __version__, "torch": torch.__version__}
    for pkg in ("transformers", "onnx", "onnxruntime", "onnxscript"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    if target != "onnx":
        out[target] = trt_version(target)
    return out


def default_out(model: str, cfg: BuildConfig) -> Path:
    name = Path(str(model).rstrip("/")).name or "model"
    if name == "verifier":  # the tiny pairs: use the pair's folder name
        name = Path(str(model).rstrip("/")).parent.name
    return Path("artifacts") / f"{name}-{cfg.mode}-n{cfg.tree_size}-{cfg.dtype}-{cfg.target}"


def build(model: str, drafter: str, out: str | Path | None, cfg: BuildConfig, *, force: bool = False,
          validate: bool = True, log: Callable[[str], None] = print) -> Path:
    cfg.validate()
    out = Path(out) if out else default_out(model, cfg)
    if out.exists() and not force:
        raise TreeFlashError(f"{out} already exists; pass --force to replace it or choose another --out")
    tree = cfg.tree()
    from ..checkpoints import eos_token_ids, load_pair

    steps = 4 + (cfg.target != "onnx")
    t0 = time.perf_counter()

    def step(i, text):
        log(f"[{i}/{steps}] {text} ({time.perf_counter() - t0:.1f}s)")

    step(1, f"loading {model} and {drafter}")
    dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[cfg.dtype]

    def check(vcfg, dcfg):
        tree.validate(block_size=dcfg.block_size, vocab_size=dcfg.vocab_size, has_head=dcfg.has_head)

    pair = load_pair(model, drafter, dtype=dtype, device="cpu", check=check)
    tree = tree.resolved(pair.drafter_cfg.block_size)
    verifier, modules = graph_modules(pair, tree, cfg.variant)
    sh = _shapes(verifier, pair.drafter_cfg, tree, cfg)
    specs = graph_specs(sh, cfg.dtype)

    with atomic_folder(out) as tmp:
        (tmp / "onnx").mkdir()
        graphs = {}
        for i, name in enumerate(GRAPHS):
            step(2, f"exporting {name} graph to ONNX ({i + 1}/{len(GRAPHS)})")
            path = tmp / "onnx" / f"{name}.onnx"
            export_onnx(modules[name], specs[name], example_inputs(name, sh, dtype, seed=0), path, cfg.opset,
                        custom_ops=cfg.variant == "plugin")
            graphs[name] = {"spec": specs[name].to_dict(), "onnx": f"onnx/{name}.onnx",
                            "weight_bytes": onnx_weight_bytes(path)}
        report = {}
        if validate:
            step(3, "checking every graph in ONNX Runtime against the eager model")
            try:
                import onnxruntime  # noqa: F401
            except ImportError:
                raise TreeFlashError("validation needs onnxruntime: pip install 'treeflash-export[onnx]' "
                                     "or pass --no-validate") from None
            if cfg.dtype == "float32":
                for name in GRAPHS:
                    cases = [example_inputs(name, sh, dtype, seed=s) for s in (1, 2)]
                    if name == "verify":  # plain decoding and a full prefill chunk too
                        cases += [example_inputs(name, sh, dtype, seed=3, n=1),
                                  example_inputs(name, sh, dtype, seed=4, n=sh.max_tokens)]
                    report[name] = parity(modules[name], specs[name], tmp / "onnx" / f"{name}.onnx", cases, cfg.dtype)
                    for out_name, r in report[name].items():
                        log(f"    {name}.{out_name}: max |ort - eager| = {r['max_abs_diff']:.2e} "
                            f"(tolerance {r['tolerance']:.0e}) {'ok' if r['ok'] else 'FAIL'}")
                bad = [f"{g}.{o}" for g, r in report.items() for o, v in r.items() if not v["ok"]]
                if bad:
                    raise TreeFlashError(f"exported graphs disagree with the eager model: {', '.join(bad)}")
            else:
                log("    parity is checked on fp32 builds only (ONNX Runtime's CPU kernels lack "
                    f"{cfg.dtype} for most ops)")
        else:
            step(3, "skipping the ONNX Runtime check (--no-validate)")
        if cfg.target != "onnx":
            import onnx
            from treeflash_plugins.onnx_ops import split_for_tensorrt, uses_custom_ops

            (tmp / "engines").mkdir()
            cache = tmp / "engines" / "timing.cache" if cfg.target == "tensorrt" else None
            for name in GRAPHS:
                step(4, f"building {cfg.target} engine for {name}")
                plan = tmp / "engines" / f"{name}{ENGINE_SUFFIX[cfg.target]}"
                source = tmp / "onnx" / f"{name}.onnx"
                graph = onnx.load(str(source), load_external_data=False)
                plugins = cfg.variant == "plugin" and uses_custom_ops(graph)
                if plugins:  # one plugin node per kernel (TensorRT's ahead-of-time plugins launch one each)
                    # Weights kept in an external file stay there: the split graph points at the same file.
                    source = source.with_name(f"{name}.tensorrt.onnx")
                    onnx.save(split_for_tensorrt(graph), str(source))
                    graphs[name]["onnx_tensorrt"] = source.relative_to(tmp).as_posix()
                size = build_engine(source, specs[name], plan, flavor=cfg.target, timing_cache=cache,
                                    plugins=plugins)
                graphs[name]["engine"] = plan.relative_to(tmp).as_posix()
                log(f"    {plan.name}: {size / 1e6:.1f} MB")
        step(steps, "writing tokenizer and manifest")
        _copy_tokenizer(pair.verifier_path, tmp / "tokenizer")
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "versions": _versions(cfg.target),
            "sources": {"verifier": str(model), "drafter": str(drafter), "drafter_layout": pair.drafter_layout},
            "build": dataclasses.asdict(cfg),
            "tree": dataclasses.asdict(tree),
            "shapes": dataclasses.asdict(sh),
            "stop_token_ids": eos_token_ids(pair.tokenizer, pair.verifier),
            "graphs": graphs,
            "parity": report,
            "files": file_table(tmp),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    log(f"artifact written to {out} ({time.perf_counter() - t0:.1f}s)")
    return out


def _copy_tokenizer(src: Path, dst: Path) -> None:
    dst.mkdir()
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
