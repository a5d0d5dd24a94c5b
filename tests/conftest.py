"""Shared fixtures: tiny model pairs written once per session in the released layouts."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if any(Path(p or os.getcwd()).resolve() == ROOT for p in sys.path):
    # `python -m pytest` from the checkout puts its root first on sys.path, where the folders kernels/ and
    # runtime/ shadow the PyPI distributions of those names (transformers imports `kernels`).
    raise pytest.UsageError("the checkout's root is on sys.path: its kernels/ folder hides the `kernels` package "
                            "that transformers imports. Run `make test`, `.venv/bin/pytest`, or `python -P -m pytest`.")

import torch  # noqa: E402

if not torch.cuda.is_available():  # Triton kernels run in Triton's interpreter on CPU machines
    os.environ.setdefault("TRITON_INTERPRET", "1")
from transformers import GenerationConfig
from transformers.utils import logging as hf_logging

from treeflash_export.checkpoints import load_pair
from treeflash_export.tiny import write_tiny_pair

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()
# 2 threads as on CI's 2-core machines; `make gpu-test-rest` gives a larger machine all its cores.
torch.set_num_threads(int(os.environ.get("TREEFLASH_TEST_THREADS", "2")))

PAIRS = {
    # name: (verifier family, drafter layout)
    "qwen3": ("qwen3", "treeflash"),
    "llama": ("llama", "treeflash"),
    "qwen3-dflash": ("qwen3", "dflash"),
}

PROMPTS = [
    "def main(argv):\n    ",
    "The quick brown fox",
    "import os\nimport sys\n\nclass Path",
]


@pytest.fixture(scope="session")
def pair_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pairs")
    return {name: write_tiny_pair(root / name, family=fam, layout=layout, seed=i)
            for i, (name, (fam, layout)) in enumerate(PAIRS.items())}


_loaded = {}


@pytest.fixture(scope="session")
def load(pair_dirs):
    """load(name) -> LoadedPair (cached)."""

    def _load(name):
        if name not in _loaded:
            d = pair_dirs[name]
            _loaded[name] = load_pair(str(d / "verifier"), str(d / "drafter"))
        return _loaded[name]

    return _load


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """The verifier's own greedy continuation through transformers' generate, n tokens, never stopping
    at EOS (an empty EOS list; None would fall back to the model's EOS, and min_new_tokens would
    suppress EOS logits and change the argmax). The attention mask is given: inferred, it would hide
    every prompt token equal to the pad id."""
    cfg = GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=[], pad_token_id=0)
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), generation_config=cfg)
    return out[0, len(ids):].tolist()


def compile_for_hopper(module: str, kernels: list[tuple[str, dict, dict, int | dict]]) -> dict:
    """triton.compile each (kernel name in ``module``, signature, constexprs, num_warps or the launch
    options) for sm_90, with no GPU, in a child process (where launches are interpreted, Triton cannot
    also generate code in the same process) -> {entry name: {"sm90": PTX targets sm_90, "shared":
    bytes, "fma16": PTX has a 16-bit fused multiply-add}}."""
    import json
    import subprocess
    import tempfile

    script = f"""
import json, re, triton
from triton.backends.compiler import GPUTarget
from treeflash_kernels.aot import ast_source
import {module} as m
out = {{}}
for name, sig, consts, warps in {kernels!r}:
    sig = dict(sig, **{{c: "constexpr" for c in consts}})
    options = warps if isinstance(warps, dict) else dict(num_warps=warps)
    k = triton.compile(ast_source(getattr(m, name), sig, consts), target=GPUTarget("cuda", 90, 32),
                       options=options)
    ptx = k.asm["ptx"]
    out[k.metadata.name] = dict(sm90=".target sm_90" in ptx, shared=k.metadata.shared,
                                fma16=bool(re.search(r"fma\\.rn\\.(f16|bf16)", ptx)))
print(json.dumps(out))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # Outside the checkout: `-c` puts the working folder on sys.path (see the check at the top).
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          cwd=tempfile.gettempdir())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def make_inputs(B, M, H, I, V, dtype=torch.float32, device="cpu", seed=0):
    """The MLP expansion's inputs (the kernel benchmark's), with the two norms' epsilons told apart."""
    from treeflash_kernels.bench import make_problem

    return make_problem(B, M, H, I, V, dtype, device, seed, norm_eps=1e-5)


def write_turn_pair(src, dst, token: int):
    """A copy of the pair folder ``src`` at ``dst`` whose verifier writes <|im_end|> wherever it wrote
    ``token``: the rows of the two in its LM head are swapped. Where ``token`` is the first occurrence of a
    token in a greedy continuation that never writes <|im_end|>, every earlier argmax is unchanged (the
    logit <|im_end|> now gets was below each of them) and the verifier itself ends its turn there."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    im_end = AutoTokenizer.from_pretrained(str(src / "verifier")).convert_tokens_to_ids("<|im_end|>")
    shutil.copytree(src, dst)
    weights = dst / "verifier" / "model.safetensors"
    state = load_file(str(weights))
    head = state["lm_head.weight"].clone()
    head[[token, im_end]] = head[[im_end, token]]
    state["lm_head.weight"] = head
    save_file(state, str(weights), metadata={"format": "pt"})
    return dst


@contextlib.contextmanager
def one_thread():
    """Tiny models gain nothing from a second thread, and on a busy machine each op's thread barrier waits
    for a core: many small generations (and the in-process references of the server tests) run on one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
