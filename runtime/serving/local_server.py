"""A real Triton Inference Server on this machine's CPU, from the `tritonserver` binary that the
nvidia-pytriton wheel bundles (install with `pip install 'treeflash-export[serve]'`).

The recipe: copy the bundled server folder, put the Python-backend stub built for this
interpreter into backends/python/, run it with the wheel's libraries and this interpreter's
libpython on LD_LIBRARY_PATH (without the latter the stub loads the system libpython and
crashes) and this environment's bin/ first on PATH (so the stub imports what is installed
here), every address bound to 127.0.0.1 on free ports; ready when /v2/health/ready answers 200.

    python -P -m treeflash_runtime.serving.local_server REPO     # serves REPO until Ctrl-C or SIGTERM
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from treeflash_export.errors import TreeFlashError

HOST = "127.0.0.1"


def bundled_server() -> tuple[Path, Path]:
    """(the wheel's tritonserver folder, its bundled shared libraries)."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise TreeFlashError("no tritonserver here: pip install 'treeflash-export[serve]' (nvidia-pytriton==0.7.0 "
                             "bundles a CPU tritonserver)")
    pkg = Path(list(spec.submodule_search_locations)[0])
    server, libs = pkg / "tritonserver", pkg.parent / "nvidia_pytriton.libs"
    if not (server / "bin" / "tritonserver").is_file() or not libs.is_dir():
        raise TreeFlashError(f"{pkg} has no bundled tritonserver: reinstall nvidia-pytriton==0.7.0")
    return server, libs


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@dataclass
class LocalServer:
    process: subprocess.Popen
    http_port: int
    grpc_port: int
    log_path: Path
    scratch: Path | None = None  # a folder start_local_server made itself: removed by stop()

    @property
    def http(self) -> str:
        return f"{HOST}:{self.http_port}"

    @property
    def grpc(self) -> str:
        return f"{HOST}:{self.grpc_port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.is_file() else ""

    def stop(self, timeout: float = 30.0) -> None:
        """SIGINT to the server's process id (a graceful shutdown), SIGKILL if it hangs."""
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait()
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)


def _ready(http: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{http}/v2/health/ready", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def start_local_server(repo: str | Path, workdir: str | Path | None = None, *, timeout: float = 180.0,
                       log_verbose: int = 0) -> LocalServer:
    """Start tritonserver on REPO; returns once it is ready (or raises with the end of its log)."""
    server, libs = bundled_server()
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = server / "python_backend_stubs" / py / "triton_python_backend_stub"
    if not stub.is_file():
        raise TreeFlashError(f"nvidia-pytriton has no Python-backend stub for Python {py}")
    scratch = None if workdir else Path(tempfile.mkdtemp(prefix="treeflash-tritonserver-"))
    work = Path(workdir or scratch)
    home = work / "tritonserver"
    shutil.copytree(server, home, ignore=shutil.ignore_patterns("python_backend_stubs", "__pycache__"))
    shutil.copy2(stub, home / "backends" / "python" / stub.name)
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        [str(libs), sysconfig.get_config_var("LIBDIR")] + ([env["LD_LIBRARY_PATH"]] if env.get("LD_LIBRARY_PATH") else []))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    http_port = grpc_port = free_port()
    while grpc_port == http_port:
        grpc_port = free_port()
    cmd = [str(home / "bin" / "tritonserver"), "--model-repository", str(Path(repo).resolve()),
           "--backend-directory", str(home / "backends"), "--cache-directory", str(home / "caches"),
           "--http-address", HOST, "--http-port", str(http_port), "--grpc-address", HOST,
           "--grpc-port", str(grpc_port), "--allow-metrics", "false", "--log-verbose", str(log_verbose),
           "--exit-timeout-secs", "10"]
    log_path = work / "tritonserver.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                cwd=work, start_new_session=True)
    srv = LocalServer(proc, http_port, grpc_port, log_path, scratch)
    deadline = time.monotonic() + timeout
    try:
        while not _ready(srv.http):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = "\n".join(srv.log().splitlines()[-40:])
                raise TreeFlashError(f"tritonserver did not become ready (exit status {proc.poll()}); its log "
                                     f"ends:\n{tail}")
            time.sleep(0.25)
    except BaseException:  # not ready, or interrupted: never leave a server behind
        srv.stop()
        raise
    return srv


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        sys.exit("usage: python -P -m treeflash_runtime.serving.local_server REPO")

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # the server runs in its own session
        signal.signal(sig, interrupt)
    try:
        srv = start_local_server(argv[0])
    except TreeFlashError as exc:
        sys.exit(f"error: {exc}")
    except KeyboardInterrupt:
        sys.exit(1)
    print(f"tritonserver ready: HTTP {srv.http}, gRPC {srv.grpc} (log: {srv.log_path}); Ctrl-C stops it",
          flush=True)
    try:
        srv.process.wait()
    except KeyboardInterrupt:
        pass
    srv.stop()


if __name__ == "__main__":
    main()
