"""Export pipeline: ONNX graphs, parity, artifact integrity, ONNX Runtime exactness, engine builds."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil

import pytest
import torch
from click.testing import CliRunner
from conftest import PROMPTS, hf_greedy
from oracle import OracleOrtRunner

from treeflash_export.export import build as export_mod
from treeflash_export.export.artifact import ArtifactError, load_artifact
from treeflash_export.config import SamplingConfig, TreeConfig
from treeflash_export.export.build import BuildConfig, build
from treeflash_runtime import generate
from treeflash_runtime.backends.onnxruntime_backend import OnnxRuntimeRunner
from treeflash_runtime.cli import main as run_main

NEW = 64
TREE = dict(tree_size=16, top_m=4, top_k=4)
BUILDS = [("qwen3", "treeflash"), ("qwen3", "marginal"), ("qwen3", "chain"),
          ("llama", "treeflash"), ("llama", "marginal"), ("llama", "chain")]


@pytest.fixture(scope="module")
def artifacts(pair_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("artifacts")
    made = {}

    def get(name, mode):
        if (name, mode) not in made:
            d = pair_dirs[name]
            made[name, mode] = build(str(d / "verifier"), str(d / "drafter"), root / f"{name}-{mode}",
                                     BuildConfig(mode=mode, max_seq_len=192, prefill_chunk=16, **TREE), log=lambda m: None)
        return load_artifact(made[name, mode])

    return get


@pytest.mark.parametrize("name,mode", BUILDS)
def test_parity_report_and_manifest(artifacts, name, mode):
    art = artifacts(name, mode)
    m = art.manifest
    assert set(m["graphs"]) == {"verify", "draft", "expand"}
    for graph, outputs in m["parity"].items():
        for out, r in outputs.items():
            assert r["ok"] and r["max_abs_diff"] <= 1e-4, (graph, out, r)  # fp32: seen about 1e-6
    # Tree outputs are integers and masks: exactly equal.
    assert all(r["max_abs_diff"] == 0 for r in m["parity"]["expand"].values())
    assert m["tree"]["mode"] == mode and m["shapes"]["capacity"] == 192
    assert all(g["weight_bytes"] > 0 for g in m["graphs"].values())
    assert {"onnx/verify.onnx", "onnx/draft.onnx", "onnx/expand.onnx", "tokenizer/tokenizer.json"} <= set(m["files"])
    assert m["versions"]["treeflash_export"] and m["versions"]["onnxruntime"]


@pytest.mark.parametrize("name,mode", BUILDS)
def test_onnxruntime_greedy_equals_verifier(load, artifacts, name, mode):
    art = artifacts(name, mode)
    pair = load(name)
    runner = OnnxRuntimeRunner(art)
    for i, prompt in enumerate(PROMPTS):
        ids = pair.tokenizer(prompt)["input_ids"]
        ref = hf_greedy(pair.verifier, ids, NEW)
        res = generate(runner, ids, art.tree, SamplingConfig(max_new_tokens=NEW))
        assert res.token_ids == ref, (name, mode, i)
    res = generate(runner, ids, TreeConfig(mode="ar"), SamplingConfig(max_new_tokens=NEW))
    assert res.token_ids == ref


def test_onnxruntime_keeps_its_caches_and_never_reads_a_stale_slot(load, artifacts):
    """A second generation reuses the first one's caches (same memory, no new zeroing); filled with
    garbage in between, they still give the verifier's own greedy output: no slot is read before
    the generation writes it."""
    art, pair = artifacts("qwen3", "treeflash"), load("qwen3")
    runner = OnnxRuntimeRunner(art)
    first = pair.tokenizer(PROMPTS[0])["input_ids"]
    generate(runner, first, art.tree, SamplingConfig(max_new_tokens=NEW))
    kv, draft_kv = runner.kv, runner.draft_kv
    g = torch.Generator().manual_seed(0)
    for cache in (kv, draft_kv):
        cache.copy_(torch.randn(cache.shape, generator=g) * 50)
    ids = pair.tokenizer(PROMPTS[1])["input_ids"]
    res = generate(runner, ids, art.tree, SamplingConfig(max_new_tokens=NEW))
    assert runner.kv is kv and runner.draft_kv is draft_kv
    assert res.token_ids == hf_greedy(pair.verifier, ids, NEW)


@pytest.mark.parametrize("name,mode", [("qwen3", "treeflash"), ("llama", "marginal")])
def test_onnxruntime_oracle_rounds_accept_many_tokens(load, artifacts, name, mode):
    art = artifacts(name, mode)
    pair = load(name)
    gains = []
    for i, prompt in enumerate(PROMPTS):
        ids = pair.tokenizer(prompt)["input_ids"]
        ref = hf_greedy(pair.verifier, ids, NEW)
        res = generate(OracleOrtRunner(art, ids + ref, i), ids, art.tree, SamplingConfig(max_new_tokens=NEW))
        assert res.token_ids == ref
        gains += res.stats.accept_lengths
    assert max(gains) >= art.shapes.block - 2 and sum(gains) / len(gains) > 2.0, gains


def test_run_cli_on_artifact_all_backends(load, artifacts):
    art = artifacts("qwen3", "treeflash")
    pair = load("qwen3")
    ref = hf_greedy(pair.verifier, pair.tokenizer(PROMPTS[0])["input_ids"], 24)
    outs = {}
    for backend in ("onnxruntime", "torch"):
        r = CliRunner().invoke(run_main, ["--artifacts", str(art.root), "--backend", backend, "--prompt", PROMPTS[0],
                                          "--max-new-tokens", "24", "--ignore-eos", "--json"])
        assert r.exit_code == 0, r.stderr
        outs[backend] = json.loads(r.stdout)
        assert outs[backend]["token_ids"] == ref and outs[backend]["backend"] == backend
    assert outs["onnxruntime"]["tree_size"] == TREE["tree_size"]
    # the start-up steps: the artifact's checksums, then its graphs, or the source checkpoints
    assert set(outs["onnxruntime"]["load_stages_s"]) == {"artifact", "runner"}
    assert set(outs["torch"]["load_stages_s"]) == {"artifact", "tokenizer", "verifier", "drafter", "runner"}


def _copy(art, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(art.root, dst)
    return dst


def _cli_error(*args):
    r = CliRunner().invoke(run_main, [str(a) for a in args] + ["--prompt", "x"])
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]


def test_corrupted_or_mismatched_artifacts_are_rejected(artifacts, tmp_path):
    art = artifacts("qwen3", "treeflash")
    d = _copy(art, tmp_path)
    onnx_file = d / "onnx" / "expand.onnx"
    data = bytearray(onnx_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    onnx_file.write_bytes(bytes(data))
    assert "checksum" in _cli_error("--artifacts", d, "--backend", "onnxruntime")
    with pytest.raises(ArtifactError, match="checksum"):
        load_artifact(d)
    load_artifact(d, verify_checksums=False)  # sizes still match: only the checksum catches it

    (d / "onnx" / "draft.onnx").unlink()
    assert "draft.onnx is missing" in _cli_error("--artifacts", d, "--backend", "onnxruntime")

    d2 = tmp_path / "d2"
    shutil.copytree(art.root, d2)
    m = json.loads((d2 / "manifest.json").read_text())
    m["format_version"] = 99
    (d2 / "manifest.json").write_text(json.dumps(m))
    assert "format version 99" in _cli_error("--artifacts", d2)
    (d2 / "manifest.json").write_text("{ not json")
    assert "unreadable" in _cli_error("--artifacts", d2)
    (d2 / "manifest.json").unlink()
    assert "no manifest.json" in _cli_error("--artifacts", d2)

    assert "tree-size 16, not 32" in _cli_error("--artifacts", art.root, "--tree-size", 32)
    assert "top-k 4, not 5" in _cli_error("--artifacts", art.root, "--top-k", 5)
    assert "treeflash" in _cli_error("--artifacts", art.root, "--mode", "marginal")
    assert "max-seq-len 192" in _cli_error("--artifacts", art.root, "--max-seq-len", 256)
    assert "--artifacts replaces" in _cli_error("--artifacts", art.root, "--model", art.root)
    assert "no TensorRT engines" in _cli_error("--artifacts", art.root, "--backend", "tensorrt")


def test_interrupted_build_leaves_nothing_complete(pair_dirs, tmp_path, monkeypatch):
    d = pair_dirs["qwen3"]
    calls = {"n": 0}
    real = export_mod.export_onnx

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt  # as if the user pressed Ctrl-C during the second graph
        return real(*a, **k)

    monkeypatch.setattr(export_mod, "export_onnx", flaky)
    out = tmp_path / "art"
    with pytest.raises(KeyboardInterrupt):
        build(str(d / "verifier"), str(d / "drafter"), out, BuildConfig(max_seq_len=128, **TREE), log=lambda m: None)
    assert not out.exists()
    assert os.listdir(tmp_path) == []  # the temporary folder is gone too


def test_failed_rebuild_keeps_the_old_artifact(artifacts, pair_dirs, tmp_path, monkeypatch):
    art = artifacts("qwen3", "chain")
    d = _copy(art, tmp_path)
    before = (d / "manifest.json").read_text()

    def broken(*a, **k):
        raise RuntimeError("exporter exploded")

    monkeypatch.setattr(export_mod, "export_onnx", broken)
    p = pair_dirs["qwen3"]
    with pytest.raises(RuntimeError):
        build(str(p / "verifier"), str(p / "drafter"), d, BuildConfig(mode="chain", max_seq_len=192, **TREE),
              force=True, log=lambda m: None)
    assert (d / "manifest.json").read_text() == before
    assert sorted(x.name for x in tmp_path.iterdir()) == ["copy"]


def test_build_cli_errors(pair_dirs, tmp_path):
    from treeflash_export.cli import main as export_main

    d = pair_dirs["qwen3-dflash"]
    r = CliRunner().invoke(export_main, ["build", "--model", str(d / "verifier"), "--drafter", str(d / "drafter"),
                                         "--out", str(tmp_path / "a")])
    assert r.exit_code == 2 and "head" in r.stderr and not (tmp_path / "a").exists()
    r = CliRunner().invoke(export_main, ["build", "--model", str(d / "verifier"), "--drafter", str(d / "drafter"),
                                         "--out", str(tmp_path), "--mode", "chain"])
    assert r.exit_code == 2 and "already exists" in r.stderr


@pytest.mark.skipif(importlib.util.find_spec("tensorrt_rtx") is None,
                    reason="tensorrt-rtx is not installed (pip install tensorrt-rtx-cu13)")
def test_tensorrt_rtx_builds_every_graph(pair_dirs, tmp_path):
    """TensorRT-RTX parses, builds and serialises the fp16 reference graphs with no GPU."""
    d = pair_dirs["qwen3"]
    out = build(str(d / "verifier"), str(d / "drafter"), tmp_path / "rtx",
                BuildConfig(dtype="float16", target="tensorrt-rtx", max_seq_len=128, **TREE), log=lambda m: None)
    art = load_artifact(out)
    for g in ("verify", "draft", "expand"):
        plan = art.path(g, "engine")
        assert plan.name == f"{g}.rtx.plan" and plan.stat().st_size > 10_000
        assert art.manifest["files"][f"engines/{g}.rtx.plan"]["bytes"] == plan.stat().st_size
    assert art.manifest["versions"]["tensorrt-rtx"].startswith("1.")


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is None,
                    reason="TensorRT is not installed (it needs NVIDIA's package index and a GPU machine)")
def test_tensorrt_engines_greedy_equals_verifier(load, pair_dirs, tmp_path):
    from treeflash_runtime.backends.tensorrt_backend import TensorRTRunner

    d = pair_dirs["qwen3"]
    out = build(str(d / "verifier"), str(d / "drafter"), tmp_path / "trt",
                BuildConfig(target="tensorrt", max_seq_len=192, **TREE), log=lambda m: None)
    art = load_artifact(out)
    pair = load("qwen3")
    ids = pair.tokenizer(PROMPTS[0])["input_ids"]
    res = generate(TensorRTRunner(art), ids, art.tree, SamplingConfig(max_new_tokens=NEW))
    assert res.token_ids == hf_greedy(pair.verifier, ids, NEW)


def test_bench_on_artifact_compares_backends_and_refuses_other_modes(artifacts):
    from treeflash_runtime.bench.cli import main as bench_main

    art = artifacts("qwen3", "treeflash")
    args = ["--artifacts", str(art.root), "--backends", "torch,onnxruntime", "--max-new-tokens", "8",
            "--prompt", "def f(x):", "--json"]
    r = CliRunner().invoke(bench_main, args)
    assert r.exit_code == 0, r.stderr
    report = json.loads(r.stdout)
    assert {(row["backend"], row["mode"]) for row in report["rows"]} == {
        ("torch", "treeflash"), ("torch", "ar"), ("onnxruntime", "treeflash"), ("onnxruntime", "ar")}
    assert report["identical_outputs"] is True
    assert all(row["tree_size"] == (1 if row["mode"] == "ar" else TREE["tree_size"]) for row in report["rows"])
    r = CliRunner().invoke(bench_main, args[:-1] + ["--modes", "marginal"])
    assert r.exit_code == 2 and "built for mode 'treeflash'" in r.stderr


def test_onnxruntime_generation_exactly_at_the_cache_capacity(load, artifacts):
    """The artifact's cache (192) holds prompt + (budget - 1) + tree exactly: the generation reaches its budget
    with the verifier's own tokens; one token more is the one-line error, exit status 2."""
    art, pair = artifacts("qwen3", "treeflash"), load("qwen3")
    ids = pair.tokenizer(PROMPTS[1])["input_ids"]
    S, N = art.shapes.capacity, TREE["tree_size"]
    budget = S - len(ids) + 1 - N
    args = ["--artifacts", str(art.root), "--backend", "onnxruntime", "--prompt", PROMPTS[1], "--ignore-eos"]
    r = CliRunner().invoke(run_main, [*args, "--max-new-tokens", str(budget), "--json"])
    assert r.exit_code == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["new_tokens"] == budget and out["token_ids"] == hf_greedy(pair.verifier, ids, budget)
    r = CliRunner().invoke(run_main, [*args, "--max-new-tokens", str(budget + 1)])
    assert r.exit_code == 2 and r.stdout == "" and r.stderr.strip().splitlines()[-1] == (
        f"error: prompt ({len(ids)}) + max new tokens ({budget + 1}) + tree ({N}) needs {S + 1} cache slots but the "
        f"cache holds {S}: lower --max-new-tokens or raise --max-seq-len")


def test_a_file_whose_size_differs_from_the_manifest_is_rejected(artifacts, tmp_path):
    art = artifacts("qwen3", "treeflash")
    d = _copy(art, tmp_path)
    size = (d / "onnx" / "verify.onnx").stat().st_size
    with open(d / "onnx" / "verify.onnx", "ab") as f:
        f.write(b"\0")
    message = f"error: artifact file onnx/verify.onnx has {size + 1} bytes, manifest says {size}"
    assert _cli_error("--artifacts", d, "--backend", "onnxruntime") == message
    # the sizes are checked even where the checksums are not
    assert _cli_error("--artifacts", d, "--backend", "onnxruntime", "--no-verify-checksums") == message


def test_a_folder_that_is_not_a_treeflash_artifact_is_rejected(artifacts, pair_dirs, tmp_path):
    art = artifacts("qwen3", "treeflash")
    d = _copy(art, tmp_path)
    (d / "manifest.json").write_text(json.dumps({"format": "some-other-tool", "format_version": 1}))
    assert _cli_error("--artifacts", d) == f"error: {d / 'manifest.json'} is not a TreeFlash artifact manifest"
    (d / "manifest.json").write_text(json.dumps([1, 2]))  # JSON, but not an object
    assert _cli_error("--artifacts", d) == f"error: {d / 'manifest.json'} is not a TreeFlash artifact manifest"
    ckpt = pair_dirs["qwen3"] / "verifier"  # a checkpoint folder given as an artifact
    assert _cli_error("--artifacts", ckpt).startswith(f"error: {ckpt} has no manifest.json: not a complete artifact")
    assert "does not exist" in _cli_error("--artifacts", tmp_path / "nothing")


def test_engines_from_another_tensorrt_version_are_rejected(artifacts, tmp_path, monkeypatch):
    """With a stand-in tensorrt module of another version: refused before any engine is read or any GPU is
    needed, one line naming both versions (in process and through treeflash-run)."""
    import sys
    import types

    from treeflash_export.export.artifact import MANIFEST, file_table
    from treeflash_runtime.backends.tensorrt_backend import TensorRTRunner

    art = artifacts("qwen3", "treeflash")
    d = _copy(art, tmp_path)
    (d / "engines").mkdir()
    m = json.loads((d / MANIFEST).read_text())
    for g in ("verify", "draft", "expand"):
        (d / "engines" / f"{g}.plan").write_bytes(b"not an engine")
        m["graphs"][g]["engine"] = f"engines/{g}.plan"
    m["build"]["target"] = "tensorrt"
    m["versions"]["tensorrt"] = "10.13.3"
    m["files"] = file_table(d)
    (d / MANIFEST).write_text(json.dumps(m))
    stub = types.ModuleType("tensorrt")
    stub.__version__ = "10.9.0"
    monkeypatch.setitem(sys.modules, "tensorrt", stub)
    message = ("engines were built with TensorRT 10.13.3, this machine has 10.9.0: rebuild the artifact here "
               "(engines are not portable across versions)")
    with pytest.raises(ArtifactError) as err:
        TensorRTRunner(load_artifact(d))
    assert str(err.value) == message
    assert _cli_error("--artifacts", d, "--backend", "tensorrt") == f"error: {message}"


def test_a_build_that_fails_parity_aborts_and_leaves_nothing(pair_dirs, artifacts, tmp_path, monkeypatch):
    """Every output out of tolerance: the build stops with one line naming the failed outputs, exit status 2;
    no new folder and no temporary one, and with --force the artifact already there is left as it was."""
    from treeflash_export.cli import main as export_main

    monkeypatch.setattr(export_mod, "TOLERANCE", {"float32": -1.0})
    d = pair_dirs["qwen3"]
    args = ["build", "--model", str(d / "verifier"), "--drafter", str(d / "drafter"), "--mode", "chain",
            "--tree-size", "16", "--max-seq-len", "64", "--prefill-chunk", "8"]
    r = CliRunner().invoke(export_main, [*args, "--out", str(tmp_path / "new")])
    assert r.exit_code == 2, r.output
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: exported graphs disagree with the eager model: verify.logits, verify.features")
    assert "expand.tree_tokens" in last and os.listdir(tmp_path) == []
    old = _copy(artifacts("qwen3", "treeflash"), tmp_path)
    before = {p: p.read_bytes() for p in old.rglob("*") if p.is_file()}
    r = CliRunner().invoke(export_main, [*args, "--out", str(old), "--force"])
    assert r.exit_code == 2 and "disagree with the eager model" in r.stderr
    assert {p: p.read_bytes() for p in old.rglob("*") if p.is_file()} == before
    assert os.listdir(tmp_path) == ["copy"]


def test_build_force_swaps_a_new_artifact_in(pair_dirs, artifacts, tmp_path):
    """--force over an existing artifact: the new build replaces it whole (its manifest, its files only),
    nothing else is left beside it, and it runs."""
    from treeflash_export.cli import main as export_main

    old = _copy(artifacts("qwen3", "treeflash"), tmp_path)
    (old / "stray.txt").write_text("from before")
    d = pair_dirs["qwen3"]
    r = CliRunner().invoke(export_main, ["build", "--model", str(d / "verifier"), "--drafter", str(d / "drafter"),
                                         "--out", str(old), "--mode", "chain", "--tree-size", "16", "--max-seq-len", "64",
                                         "--prefill-chunk", "8", "--no-validate"])
    assert r.exit_code == 2 and "already exists; pass --force" in r.stderr
    r = CliRunner().invoke(export_main, ["build", "--model", str(d / "verifier"), "--drafter", str(d / "drafter"),
                                         "--out", str(old), "--mode", "chain", "--tree-size", "16", "--max-seq-len", "64",
                                         "--prefill-chunk", "8", "--no-validate", "--force"])
    assert r.exit_code == 0, r.stderr
    assert os.listdir(tmp_path) == ["copy"] and not (old / "stray.txt").exists()
    art = load_artifact(old)
    assert art.tree.mode == "chain" and art.shapes.capacity == 64
    assert set(art.manifest["files"]) == {p.relative_to(old).as_posix() for p in old.rglob("*")
                                          if p.is_file() and p.name != "manifest.json"}
    r = CliRunner().invoke(run_main, ["--artifacts", str(old), "--backend", "onnxruntime", "--prompt", "x = 1",
                                      "--max-new-tokens", "4", "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["mode"] == "chain"
