"""The GPU targets of the Makefile report failure: a lent machine's run that fails must exit non-zero
and show its first error (a pipe into tee hid pytest's status; a benchmark whose paths all failed
printed nothing). Run with a stand-in Python that fails where the real commands would."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(shutil.which("make") is None or shutil.which("bash") is None,
                                reason="needs make and bash")


def fake_python(tmp_path: Path) -> Path:
    """Fails like pytest with a failing test, or like the benchmark with a failed path (rows and a
    `failed` entry on stdout, exit 1); anything else goes to this interpreter."""
    failed = json.dumps({"rows": [], "batch_rows": [], "failed": {"fast kernels": "RuntimeError: no kernel\nmore"}})
    script = tmp_path / "python"
    script.write_text(f"""#!/usr/bin/env bash
if [ "$1 $2" = "-m pytest" ]; then echo "FAILED tests/x.py::test_y - AssertionError"; exit 1; fi
if [ "$1 $2" = "-m treeflash_runtime.bench.cli" ]; then echo '{failed}'; exit 1; fi
exec {sys.executable} "$@"
""")
    script.chmod(0o755)
    return script


@pytest.mark.parametrize("target,shown", [("gpu-test", "FAILED tests/x.py::test_y"),
                                          ("gpu-test-rest", "FAILED tests/x.py::test_y"),
                                          ("gpu-bench", "FAILED fast kernels RuntimeError: no kernel"),
                                          ("gpu-bench-batch", None)])
def test_a_failing_gpu_target_exits_non_zero_and_shows_why(tmp_path, target, shown):
    r = subprocess.run(["make", "-o", "gpu-install", target, f"PYTHON={fake_python(tmp_path)}",
                        f"GPU_OUT={tmp_path / 'out'}"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0, r.stdout + r.stderr
    if shown:
        assert shown in r.stdout, r.stdout + r.stderr
