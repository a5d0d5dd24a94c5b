"""The `plugin` graph variant: one treeflash.MlpExpand node, run by ONNX Runtime through its
function body, equal to the `reference` variant; the per-kernel split TensorRT builds; the
plugin-free form TensorRT-RTX builds."""

from __future__ import annotations

import importlib.util

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner
from conftest import PROMPTS, hf_greedy
from onnx import TensorProto, helper
from conftest import make_inputs

from treeflash_export.export.artifact import load_artifact
from treeflash_export.config import SamplingConfig
from treeflash_export.export.build import BuildConfig, build, example_inputs
from treeflash_kernels.aot import KERNELS
from treeflash_kernels.mlp_expand import mlp_expand_reference
from treeflash_plugins import onnx_ops
from treeflash_runtime import generate
from treeflash_runtime.backends.onnxruntime_backend import OnnxRuntimeRunner

TREE = dict(tree_size=16, top_m=4, top_k=4)
NEW = 48


@pytest.fixture(scope="module")
def variants(pair_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("variants")
    d = pair_dirs["qwen3"]
    return {v: load_artifact(build(str(d / "verifier"), str(d / "drafter"), root / v,
                                   BuildConfig(variant=v, max_seq_len=192, prefill_chunk=16, **TREE),
                                   log=lambda m: None))
            for v in ("reference", "plugin")}


def custom_nodes(model):
    return [n for n in model.graph.node if n.domain == onnx_ops.DOMAIN]


def test_plugin_graph_has_one_custom_node(variants):
    art = variants["plugin"]
    assert art.manifest["build"]["variant"] == "plugin"
    expand = onnx.load(str(art.path("expand", "onnx")))
    (node,) = custom_nodes(expand)
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert node.op_type == "MlpExpand" and len(node.input) == len(onnx_ops.INPUTS)
    assert attrs["plugin_namespace"] == b"treeflash" and attrs["plugin_version"] == b"1"
    assert attrs["head_eps"] == pytest.approx(1e-6) and attrs["norm_eps"] > 0
    assert not expand.functions  # the file carries no body: TensorRT's parser must reach its plugin registry
    assert any(o.domain == "treeflash" for o in expand.opset_import)
    for g in ("verify", "draft"):
        assert not custom_nodes(onnx.load(str(art.path(g, "onnx"))))
    # The reference variant has no custom node at all.
    assert not custom_nodes(onnx.load(str(variants["reference"].path("expand", "onnx"))))
    for outputs in art.manifest["parity"].values():
        assert all(r["ok"] and r["max_abs_diff"] <= 1e-4 for r in outputs.values())


def test_plugin_variant_equals_reference_variant(variants):
    """The same expand inputs through both variants' ONNX files in ONNX Runtime: identical trees."""
    sh = variants["plugin"].shapes
    sessions = {v: onnx_ops.ort_session(a.path("expand", "onnx")) for v, a in variants.items()}
    names = [s.name for s in variants["plugin"].spec("expand").outputs]
    for seed in range(6):
        z, root = example_inputs("expand", sh, torch.float32, seed=seed)
        feeds = {"z": z.numpy(), "root": root.numpy()}
        ref, plug = (sessions[v].run(names, feeds) for v in ("reference", "plugin"))
        for name, a, b in zip(names, ref, plug):
            assert np.array_equal(a, b), (seed, name)


def _single_node_model(B, M, H, I, V):
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    shapes = {"z": (f, [B, H]), "parent_ids": (i64, [B - 1, M]), "embed_weight": (f, [V, H]),
              "head_norm_weight": (f, [H]), "ug_weight": (f, [2 * I, 2 * H]), "ug_bias": (f, [2 * I]),
              "d_weight": (f, [H, I]), "norm_weight": (f, [H])}
    node = helper.make_node("MlpExpand", list(onnx_ops.INPUTS), ["out"], domain=onnx_ops.DOMAIN, head_eps=1e-6,
                            norm_eps=1e-5, plugin_namespace="treeflash", plugin_version="1")
    graph = helper.make_graph([node], "mlp_expand",
                              [helper.make_tensor_value_info(n, *shapes[n]) for n in onnx_ops.INPUTS],
                              [helper.make_tensor_value_info("out", f, [B - 1, M, H])])
    return helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 18),
                                                   helper.make_opsetid(onnx_ops.DOMAIN, 1)])


@pytest.mark.parametrize("shape", [(4, 3, 40, 24, 50), (2, 1, 16, 16, 20), (6, 5, 72, 80, 64)])
def test_function_body_matches_reference(tmp_path, shape):
    path = tmp_path / "m.onnx"
    onnx.save(_single_node_model(*shape), str(path))
    args = make_inputs(*shape)
    out = onnx_ops.ort_session(path).run(["out"], {n: a.numpy() for n, a in zip(onnx_ops.INPUTS, args[:8])})[0]
    err = np.abs(out - mlp_expand_reference(*args).numpy()).max()
    assert err < 1e-5, err


def test_loop_over_plugin_graphs_is_exact(load, variants):
    art = variants["plugin"]
    pair = load("qwen3")
    runner = OnnxRuntimeRunner(art)
    for prompt in PROMPTS:
        ids = pair.tokenizer(prompt)["input_ids"]
        res = generate(runner, ids, art.tree, SamplingConfig(max_new_tokens=NEW))
        assert res.token_ids == hf_greedy(pair.verifier, ids, NEW), prompt


def test_oracle_rounds_over_plugin_graphs(load, variants):
    from oracle import OracleOrtRunner

    art = variants["plugin"]
    pair = load("qwen3")
    ids = pair.tokenizer(PROMPTS[1])["input_ids"]
    ref = hf_greedy(pair.verifier, ids, NEW)
    res = generate(OracleOrtRunner(art, ids + ref, 3), ids, art.tree, SamplingConfig(max_new_tokens=NEW))
    assert res.token_ids == ref
    gains = res.stats.accept_lengths  # one prompt: deep rounds, not necessarily a whole block
    assert sum(gains) / len(gains) > 2.0 and max(gains) >= art.shapes.block // 2, gains


def test_split_for_tensorrt_follows_the_kernels(variants):
    """One plugin node per kernel, each with as many inputs as its kernel has leading pointers and one
    output (TensorRT's ahead-of-time calling convention), wired in the launcher's order."""
    art = variants["plugin"]
    split = onnx_ops.split_for_tensorrt(onnx.load(str(art.path("expand", "onnx"))))
    assert not [n for n in custom_nodes(split) if n.op_type == "MlpExpand"]
    stages = custom_nodes(split)
    assert [n.op_type for n in stages] == ["ExpandPrologue", "SwigluGemm", "DownResidual", "RmsNorm"]
    kernel_of = {"ExpandPrologue": "expand_prologue", "SwigluGemm": "swiglu_gemm", "DownResidual": "down_residual",
                 "RmsNorm": "rms_norm"}
    for node in stages:
        args = KERNELS[kernel_of[node.op_type]][1]
        pointers_in = next(i for i, (_, kind) in enumerate(args) if kind == "i32")
        assert len(node.input) == pointers_in == len(onnx_ops.STAGES[node.op_type][0]), node.op_type
        assert len(node.output) == 1 and args[-1][1] in ("T", "F32")
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["plugin_namespace"] == b"treeflash" and attrs["plugin_version"] == b"1"
    for prev, node in zip(stages, stages[1:]):
        assert node.input[0] == prev.output[0]
    down = {a.name: helper.get_attribute_value(a) for a in stages[2].attribute}
    assert down["top_m"] == art.shapes.top_m


def test_plugin_free_form_runs_and_builds_with_tensorrt_rtx(variants, tmp_path):
    """The plugin graph with its function inlined: standard ops only, equal outputs in ONNX Runtime,
    and (where tensorrt-rtx is installed) a serialised TensorRT-RTX engine."""
    art = variants["plugin"]
    inlined = onnx_ops.inline_custom_ops(onnx.load(str(art.path("expand", "onnx"))))
    assert not custom_nodes(inlined) and not inlined.functions
    path = tmp_path / "expand.inlined.onnx"
    onnx.save(inlined, str(path))
    names = [s.name for s in art.spec("expand").outputs]
    z, root = example_inputs("expand", art.shapes, torch.float32, seed=11)
    feeds = {"z": z.numpy(), "root": root.numpy()}
    a = onnx_ops.ort_session(path).run(names, feeds)
    b = onnx_ops.ort_session(art.path("expand", "onnx")).run(names, feeds)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    if importlib.util.find_spec("tensorrt_rtx") is None:
        pytest.skip("tensorrt-rtx is not installed (pip install tensorrt-rtx-cu13)")
    from treeflash_export.export.engines import build_engine

    size = build_engine(path, art.spec("expand"), tmp_path / "expand.rtx.plan", flavor="tensorrt-rtx")
    assert size > 10_000


def test_tensorrt_plugin_build_wiring(pair_dirs, tmp_path, monkeypatch):
    """--target tensorrt --variant plugin without TensorRT: the engine builder is replaced by a recorder,
    to check what the build hands it (the split graph for expand, with plugins; the plain files otherwise)."""
    from treeflash_export.export import build as export_mod

    calls = {}

    def fake_build_engine(onnx_path, spec, plan_path, *, flavor, timing_cache=None, plugins=False):
        calls[spec.name] = (onnx_path.name, plugins)
        plan_path.write_bytes(b"plan")
        return 4

    monkeypatch.setattr(export_mod, "build_engine", fake_build_engine)
    d = pair_dirs["qwen3"]
    out = build(str(d / "verifier"), str(d / "drafter"), tmp_path / "trt",
                BuildConfig(target="tensorrt", variant="plugin", max_seq_len=128, **TREE), validate=False,
                log=lambda m: None)
    assert calls == {"verify": ("verify.onnx", False), "draft": ("draft.onnx", False),
                     "expand": ("expand.tensorrt.onnx", True)}
    art = load_artifact(out)
    assert art.manifest["graphs"]["expand"]["onnx_tensorrt"] == "onnx/expand.tensorrt.onnx"
    split = onnx.load(str(out / "onnx" / "expand.tensorrt.onnx"))
    assert [n.op_type for n in custom_nodes(split)] == ["ExpandPrologue", "SwigluGemm", "DownResidual", "RmsNorm"]


def test_plugin_build_errors(pair_dirs, tmp_path):
    from treeflash_export.cli import main as export_main

    d = pair_dirs["qwen3"]
    base = ["build", "--model", str(d / "verifier"), "--drafter", str(d / "drafter"), "--variant", "plugin"]
    r = CliRunner().invoke(export_main, base + ["--mode", "marginal", "--out", str(tmp_path / "a")])
    assert r.exit_code == 2 and "--variant plugin" in r.stderr and not (tmp_path / "a").exists()
    r = CliRunner().invoke(export_main, base + ["--target", "tensorrt-rtx", "--out", str(tmp_path / "b")])
    assert r.exit_code == 2 and "no plugin API" in r.stderr and not (tmp_path / "b").exists()


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="TensorRT is installed here")
def test_load_plugins_without_tensorrt_says_what_is_missing():
    from treeflash_plugins import load_plugins

    with pytest.raises(ImportError, match="TensorRT 10.8"):
        load_plugins()


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is None or not torch.cuda.is_available(),
                    reason="TensorRT plugins need TensorRT and a CUDA GPU (TensorRT is not installable here)")
def test_tensorrt_plugin_engines_greedy_equals_verifier(load, pair_dirs, tmp_path):
    from treeflash_plugins import load_plugins
    from treeflash_runtime.backends.tensorrt_backend import TensorRTRunner

    assert load_plugins() == load_plugins()  # idempotent
    d = pair_dirs["qwen3"]
    out = build(str(d / "verifier"), str(d / "drafter"), tmp_path / "trt-plugin",
                BuildConfig(target="tensorrt", variant="plugin", max_seq_len=192, **TREE), log=lambda m: None)
    art = load_artifact(out)
    pair = load("qwen3")
    ids = pair.tokenizer(PROMPTS[0])["input_ids"]
    res = generate(TensorRTRunner(art), ids, art.tree, SamplingConfig(max_new_tokens=NEW))
    assert res.token_ids == hf_greedy(pair.verifier, ids, NEW)
