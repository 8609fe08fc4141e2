"""Where a measurement came from: `results.json`'s top-level `provenance` object.

`{"backend": "trtllm"|"triton"|"golden"|"emulation"|"openai", "target": engine dir / checkpoint dir / server URL,
"host": {"cpu": model name, "gpus": [name, ...]}, "versions": {package: version}, "git_revision": commit or null,
"started": ISO-8601 UTC}`. The host is the machine the load generator ran on (for a Triton server, the client's).
A number without these cannot be compared with another one, so every results file carries them.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

BACKENDS = ("trtllm", "triton", "golden", "emulation", "openai")
# The packages whose version changes a measured number.
PACKAGES = ("dflash-trt", "torch", "transformers", "tensorrt_llm", "tensorrt", "tritonclient")


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what the platform module knows."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def gpu_names() -> list[str]:
    """The GPUs `nvidia-smi` lists; none on a host without the NVIDIA driver."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        done = subprocess.run(
            [smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in done.stdout.splitlines() if line.strip()] if done.returncode == 0 else []


def package_versions() -> dict[str, str]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return versions


def git_revision() -> str | None:
    """The commit of the source tree this package runs from; None for an installed wheel or without git."""
    source = Path(__file__).resolve().parents[2]
    if not (source / ".git").exists() or shutil.which("git") is None:
        return None
    try:
        done = subprocess.run(
            ["git", "-C", str(source), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def collect(backend: str, target: str) -> dict[str, Any]:
    """The provenance of a run starting now against `target` through `backend`."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    return {
        "backend": backend,
        "target": target,
        "host": {"cpu": cpu_name(), "gpus": gpu_names()},
        "versions": package_versions(),
        "git_revision": git_revision(),
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
