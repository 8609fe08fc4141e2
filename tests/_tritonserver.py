"""A real Triton Inference Server (2.51, python backend; `.ci/install_tritonserver.sh`, run by `make test`) started
on a model repository through the repository's own launch script, on free loopback ports, and always killed."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from dflash_trt.triton.repository import LAUNCH_SCRIPT

ROOT = Path(__file__).resolve().parents[1]
TRITONSERVER = Path(os.environ.get("DFLASH_TRT_TRITONSERVER", ROOT / ".tritonserver" / "tritonserver"))
START_TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunningServer:
    """tritonserver on the repository through its own launch script, on free loopback ports."""

    def __init__(self, repo: Path, log: Path, exit_timeout_s: int = 5):
        self.repo, self.log, self.exit_timeout_s = repo, log, exit_timeout_s
        self.http, self.grpc = _free_port(), _free_port()
        self.process: subprocess.Popen | None = None
        self.startup_s = 0.0

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.grpc}"

    def start(self, **env: str) -> None:
        args = [
            str(self.repo / LAUNCH_SCRIPT),
            "--http-address=127.0.0.1",
            "--grpc-address=127.0.0.1",
            f"--http-port={self.http}",
            f"--grpc-port={self.grpc}",
            "--allow-metrics=false",
            f"--exit-timeout-secs={self.exit_timeout_s}",
        ]
        start = time.perf_counter()
        with open(self.log, "ab") as log:
            environ = {**os.environ, "TRITONSERVER": str(TRITONSERVER), **env}
            self.process = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, env=environ, start_new_session=True
            )
        deadline = start + START_TIMEOUT_S
        while time.perf_counter() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"tritonserver exited with {self.process.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.http}/v2/health/ready", timeout=2) as r:
                    if r.status == 200:
                        self.startup_s = time.perf_counter() - start
                        return
            except OSError:
                pass
            time.sleep(0.5)
        self.stop()
        pytest.fail(f"tritonserver not ready after {START_TIMEOUT_S} s:\n{self.log.read_text()[-3000:]}")

    def __enter__(self) -> RunningServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """SIGTERM to the server, then SIGKILL to its process group: python stubs outlive a killed server."""
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
        self.process = None
