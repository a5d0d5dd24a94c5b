"""Training on two CPU processes (DistributedDataParallel over gloo, started by torchrun or
torch.multiprocessing): the weights equal one process's with the same global batch, and a run
interrupted after a checkpoint resumes, under the same or another number of processes.

Tolerance: fp32 weights within atol 1e-5 of the one-process run (the ranks' gradients are
averaged in another summation order); a resume under the same split is bit-identical."""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from treeflash_export.training import loop as train_mod
from treeflash_export.errors import ConfigError
from treeflash_export.training.config import TrainConfig
from treeflash_export.training.loop import train

# warmup 100 is the CLI's default (the CLI has no --warmup); a larger lr makes the few steps count.
CFG = TrainConfig(block_size=4, draft_layers=1, intermediate_size=96, num_taps=2, train_prompts=16,
                  heldout_prompts=8, prompt_tokens=12, continuation_tokens=12, gen_batch=16, steps=6, batch_size=2,
                  anchors=4, lr=0.05, eval_every=2, save_every=2)
ATOL = 1e-5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli_options(cfg: TrainConfig) -> list[str]:
    names = ("steps", "batch_size", "grad_accum", "anchors", "lr", "block_size", "draft_layers", "intermediate_size",
             "num_taps", "train_prompts", "heldout_prompts", "prompt_tokens", "continuation_tokens", "gen_batch",
             "eval_every", "save_every")
    return [arg for n in names for arg in (f"--{n.replace('_', '-')}", str(getattr(cfg, n)))]


def torchrun(nproc: int, verifier: str, out, work, cfg: TrainConfig, *extra: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), "-m", "treeflash_export.cli", "train", "--model", verifier,
           "--out", str(out), "--work", str(work), *cli_options(cfg), *extra]
    # cwd: `-m` puts the working folder on sys.path, and the checkout's kernels/ hides a package
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=work.parent)
    assert r.returncode == 0, r.stderr[-3000:]


def weights(work) -> dict[str, torch.Tensor]:
    return torch.load(work / "last.pt", weights_only=False)["model"]


def max_diff(a, b) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def copy_data(src, dst) -> None:
    dst.mkdir()
    for path in src.glob("*-*.pt"):  # the cached splits, not the checkpoint
        shutil.copy(path, dst / path.name)


def _interrupted_rank(rank: int, port: int, verifier: str, out, work, cfg: TrainConfig) -> None:
    """One of two ranks of a run that is interrupted right after its second checkpoint."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    real, calls = train_mod._save_checkpoint, []

    def save_then_stop(world, path, state):
        real(world, path, state)
        calls.append(state["step"])
        if len(calls) == 2:
            raise KeyboardInterrupt

    train_mod._save_checkpoint = save_then_stop
    try:
        train(verifier, out, cfg, work=work, log=lambda m: None)
    except KeyboardInterrupt:
        return
    raise AssertionError("the run was not interrupted")


@pytest.fixture(scope="module")
def ddp_run(pair_dirs, tmp_path_factory):
    """Two processes under torchrun from an empty work folder: each generates half the data."""
    root = tmp_path_factory.mktemp("ddp")
    verifier = str(pair_dirs["qwen3"] / "verifier")
    torchrun(2, verifier, root / "d", root / "w", CFG)
    return verifier, root


def test_two_processes_generate_the_data_of_one(ddp_run):
    from treeflash_export.checkpoints import load_tokenizer, load_verifier
    from treeflash_export.config import default_target_layer_ids
    from treeflash_export.training.dataset import prepare_data

    verifier, root = ddp_run
    v = load_verifier(Path(verifier), dtype=torch.float32, device="cpu")
    taps = default_target_layer_ids(int(v.config.num_hidden_layers), CFG.num_taps)
    one = prepare_data(v, load_tokenizer(Path(verifier)), verifier, CFG, taps, root / "one", log=lambda m: None)
    for split in ("train", "heldout"):
        (path,) = (root / "w").glob(f"{split}-*.pt")
        two = torch.load(path)
        assert torch.equal(two["tokens"], one[split]["tokens"])
        assert torch.allclose(two["features"].float(), one[split]["features"].float(), atol=2e-3)
    assert not list((root / "w").glob(".*share*"))  # the ranks' shares were joined and removed


@pytest.mark.parametrize("batch_size, grad_accum", [(4, 1), (2, 2), (1, 4)])
def test_two_processes_equal_one_process_with_the_same_global_batch(ddp_run, tmp_path, batch_size, grad_accum):
    verifier, root = ddp_run
    copy_data(root / "w", tmp_path / "w")
    one = dataclasses.replace(CFG, batch_size=batch_size, grad_accum=grad_accum)
    train(verifier, tmp_path / "d", one, work=tmp_path / "w", log=lambda m: None)
    two, single = weights(root / "w"), weights(tmp_path / "w")
    assert max_diff(two, single) < ATOL
    # The tolerance is small against what training changed: the head's down projection starts at zero.
    assert float(two["ar_approximation.d.weight"].abs().max()) > 100 * ATOL


def test_an_interrupted_two_process_run_resumes_under_two_or_one_process(ddp_run, tmp_path):
    verifier, root = ddp_run
    copy_data(root / "w", tmp_path / "w")
    torch.multiprocessing.spawn(_interrupted_rank, args=(free_port(), verifier, tmp_path / "d", tmp_path / "w", CFG),
                                nprocs=2)
    assert torch.load(tmp_path / "w" / "last.pt", weights_only=False)["step"] == 4 and not (tmp_path / "d").exists()
    shutil.copytree(tmp_path / "w", tmp_path / "w1")

    with pytest.raises(ConfigError, match="global batch of 4 sequences, here .* = 2"):
        train(verifier, tmp_path / "d1", CFG, work=tmp_path / "w1", resume=True, log=lambda m: None)
    torchrun(2, verifier, tmp_path / "d", tmp_path / "w", CFG, "--resume")
    assert max_diff(weights(tmp_path / "w"), weights(root / "w")) == 0.0  # same split: bit-identical
    # One process, the same global batch by accumulation: the same data order, rounding aside.
    train(verifier, tmp_path / "d1", dataclasses.replace(CFG, grad_accum=2), work=tmp_path / "w1", resume=True,
          log=lambda m: None)
    assert max_diff(weights(tmp_path / "w1"), weights(root / "w")) < ATOL
