"""A real Triton Inference Server on a model repository: found, started on loopback, stopped.

The binary is the one the `nvidia-pytriton` wheel ships (Triton 2.51, python backend only). That
wheel holds numpy below 2, so it lives in its own virtual environment (`.ci/run` makes
`.venv-triton`); optpipe finds it through $OPTPIPE_TRITON_VENV, else `.venv-triton` in the working
directory or beside optpipe's source tree. PyTriton's own launcher is not used: it writes its own
repository from Python callables, while optpipe serves the repository its Triton target wrote.

What the launch needs, each learnt the hard way (see docs/serving.md):
- the python-backend stub links libpython: the interpreter's own lib folder goes first in
  LD_LIBRARY_PATH (else the stub loads another libpython and fails on `_recursion_count`), then the
  wheel's `nvidia_pytriton.libs`;
- the stub ignores PYTHONPATH and finds its packages from the `python3` first on PATH: the venv's bin;
- the stub is per Python version and must sit in the backend folder as `triton_python_backend_stub`;
- HTTP, gRPC and metrics bound to 127.0.0.1, on free ports; a shared-memory prefix per server, so
  two servers on one machine do not share regions.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from optpipe.core.errors import OptpipeError

VENV_ENV = "OPTPIPE_TRITON_VENV"
VENV_NAME = ".venv-triton"
LOOPBACK = "127.0.0.1"
READY_TIMEOUT_S = 180.0  # MiniLM's python-backend model loads in ~10 s on 2 loaded cores; a stuck load ends here
STOP_TIMEOUT_S = 30.0
#: Lines Triton logs on every host without a GPU: not why a start failed.
_HARMLESS = re.compile(r"cuda|nvml|dcgm|gpu metrics|pinned memory", re.I)


class ServingError(OptpipeError):
    """A server could not be found, started or queried: the message says what to change."""


@dataclass(frozen=True)
class TritonInstall:
    venv: Path
    binary: Path
    libs: Path  # the wheel's nvidia_pytriton.libs
    backend: Path  # pytriton/tritonserver/backends/python
    stub: Path  # the python-backend stub for the venv's Python version
    python_libdir: Path


def find_triton() -> Optional[TritonInstall]:
    """The Triton venv, or None where none is installed (see `missing_reason`)."""
    for venv in _candidate_venvs():
        install = _install_in(venv)
        if install is not None:
            return install
    return None


def missing_reason() -> str:
    return (f"no Triton server: set ${VENV_ENV} to a venv with `pip install nvidia-pytriton==0.7.0 onnxruntime openvino` "
            f"(numpy<2; .ci/run makes {VENV_NAME})")


def _candidate_venvs() -> list[Path]:
    named = os.environ.get(VENV_ENV)
    if named:
        return [Path(named)]
    source_tree = Path(__file__).resolve().parents[2]
    return [Path.cwd() / VENV_NAME, source_tree / VENV_NAME]


def _install_in(venv: Path) -> Optional[TritonInstall]:
    python = venv / "bin" / "python"
    binaries = sorted(venv.glob("lib/python3.*/site-packages/pytriton/tritonserver/bin/tritonserver"))
    if not python.exists() or not binaries:
        return None
    site = binaries[0].parents[3]
    probe = subprocess.run(
        [str(python), "-c", "import sys, sysconfig; print(sysconfig.get_config_var('LIBDIR')); print('%d.%d' % sys.version_info[:2])"],
        capture_output=True, text=True, timeout=60,
    )
    if probe.returncode != 0:
        return None
    libdir, version = probe.stdout.split()
    tritonserver = site / "pytriton" / "tritonserver"
    stub = tritonserver / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.exists():
        return None
    return TritonInstall(venv, binaries[0], site / "nvidia_pytriton.libs", tritonserver / "backends" / "python", stub, Path(libdir))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


@dataclass
class TritonServer:
    """One tritonserver process on `repository`, loopback only. Use as a context manager."""

    repository: Path
    install: TritonInstall
    log_path: Optional[Path] = None
    host: str = LOOPBACK  # what the server binds; clients here always connect through loopback
    http_port: int = field(default_factory=free_port)
    grpc_port: int = field(default_factory=free_port)
    process: Optional[subprocess.Popen] = None
    _workspace: Optional[tempfile.TemporaryDirectory] = None

    @property
    def http_url(self) -> str:
        return f"{self._client_host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self._client_host}:{self.grpc_port}"

    @property
    def _client_host(self) -> str:
        return LOOPBACK if self.host in ("0.0.0.0", "") else self.host

    def command(self, backends: Path) -> list[str]:
        return [
            str(self.install.binary),
            f"--model-repository={self.repository}",
            f"--backend-directory={backends}",
            f"--http-address={self.host}", f"--http-port={self.http_port}",
            f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}",
            "--allow-metrics=false",  # no third listener: the statistics extension (HTTP/gRPC) has the counts
            f"--backend-config=python,shm-region-prefix-name=optpipe{os.getpid()}_{self.http_port}_",
            "--exit-on-error=true", "--strict-readiness=true", "--exit-timeout-secs=10",
            "--log-verbose=0",
        ]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)
        env.pop("PYTHONHOME", None)
        libs = [str(self.install.python_libdir), str(self.install.libs)]
        if env.get("LD_LIBRARY_PATH"):
            libs.append(env["LD_LIBRARY_PATH"])
        env["LD_LIBRARY_PATH"] = ":".join(libs)
        env["PATH"] = f"{self.install.venv / 'bin'}:{env.get('PATH', '')}"
        return env

    def start(self, ready_timeout_s: float = READY_TIMEOUT_S) -> "TritonServer":
        for what, port in (("HTTP", self.http_port), ("gRPC", self.grpc_port)):
            # Checked first: the readiness probe would otherwise be answered by whatever holds the port.
            if not port_free(self.host, port):
                raise ServingError(f"the {what} port {self.host}:{port} is in use (another server?); pick another with --{what.lower()}-port")
        self._workspace = tempfile.TemporaryDirectory(prefix="optpipe-triton-")
        backends = Path(self._workspace.name) / "backends"
        python_backend = backends / "python"
        python_backend.mkdir(parents=True)
        # The backend folder as Triton wants it, by links: the wheel's files stay where pip put them.
        for source in (self.install.backend / "libtriton_python.so", self.install.backend / "triton_python_backend_utils.py"):
            (python_backend / source.name).symlink_to(source)
        (python_backend / "triton_python_backend_stub").symlink_to(self.install.stub)
        log = open(self.log_path or Path(self._workspace.name) / "tritonserver.log", "wb")
        self._log = log
        self.process = subprocess.Popen(self.command(backends), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        env=self.environment(), start_new_session=True)
        try:
            self._wait_ready(ready_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        url = f"http://{self.http_url}/v2/health/ready"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServingError(f"tritonserver exited ({self.process.returncode}) before it was ready: {self.log_tail()}")
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200 and self.process.poll() is None:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.25)
        raise ServingError(f"tritonserver was not ready within {timeout_s:.0f} s: {self.log_tail()}")

    def log_tail(self, lines: int = 3) -> str:
        """The server's last error lines (its own words), joined into one line; the CUDA/NVML/DCGM
        complaints a CPU host always logs are left out."""
        path = Path(self._log.name) if getattr(self, "_log", None) else None
        if path is None or not path.exists():
            return "no log"
        self._log.flush()
        text = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
        text = [line for line in text if not _HARMLESS.search(line)]
        errors = [line for line in text if line.startswith("E") or "error" in line.lower()] or text
        return " | ".join(errors[-lines:])[:600] or "empty log"

    def stop(self) -> Optional[int]:
        """SIGTERM (Triton drains in-flight requests), then SIGKILL after STOP_TIMEOUT_S; the python stubs
        are in the server's own session and go with it."""
        code = None
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                code = self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                code = self.process.wait()
        elif self.process is not None:
            code = self.process.returncode
        if getattr(self, "_log", None):
            self._log.close()
        if self._workspace is not None:
            self._workspace.cleanup()
            self._workspace = None
        return code

    def __enter__(self) -> "TritonServer":
        return self.start() if self.process is None else self

    def __exit__(self, *exc) -> None:
        self.stop()
