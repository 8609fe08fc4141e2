"""Conversion processes: parallel rank writers that cannot deadlock and die with their parent, SIGTERM handled like
Ctrl-C, and leftovers of killed runs (staging, calibration scratch) cleaned by the next run.

Signals need real processes, so these tests start the CLI in a child and watch /proc. The signalled runs use
`_held_convert`, whose rank writers hold once they have announced themselves: each signal arrives while the
conversion is known to be waiting on its workers, never after it finished.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _held_convert import HOLD_DIR_VARIABLE, announced
from _pairs import PairVariant, make_pair

from dflash_trt.checkpoint.atomic import scratch_directory
from dflash_trt.conversion.convert import convert_checkpoint

REPO_ROOT = Path(__file__).resolve().parents[2]
TESTS_DIR = Path(__file__).resolve().parents[1]
HELD_CONVERT = "import sys, _held_convert; sys.exit(_held_convert.main(sys.argv[1:]))"
# Heads divisible by 8 for tp 8.
SMALL = PairVariant(heads=8, kv_heads=2, head_dim=8, draft_heads=8, draft_kv_heads=2, draft_head_dim=8)

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="watches processes through Linux /proc")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("processes"), SMALL)


def _convert_command(pair: tuple[Path, Path], out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "dflash_trt.cli",
        "convert",
        "--model_dir",
        str(pair[0]),
        "--dflash_model_dir",
        str(pair[1]),
        "--output_dir",
        str(out),
        "--tp_size",
        "8",
        *extra,
    ]


def _start_held(pair: tuple[Path, Path], out: Path, hold_dir: Path) -> subprocess.Popen:
    """A tp 8 convert with 2 held workers; its writers announce themselves in `hold_dir`."""
    hold_dir.mkdir()
    command = [sys.executable, "-c", HELD_CONVERT, *_convert_command(pair, out, "--workers", "2")[3:]]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join((str(REPO_ROOT), str(TESTS_DIR))))
    env[HOLD_DIR_VARIABLE] = str(hold_dir)
    return subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _wait_for(condition, proc: subprocess.Popen, what: str, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert proc.poll() is None, f"convert ended before {what}: {proc.stderr.read().decode()}"
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.01)


def _spawned_workers(parent: int) -> list[int]:
    """Pids of multiprocessing workers whose parent is `parent`."""
    workers = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and b"multiprocessing" in cmdline:
            workers.append(int(entry.name))
    return workers


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _assert_gone(workers: list[int]) -> None:
    """A worker still starting up notices its parent is gone once it runs its initializer: allow it time."""
    deadline = time.monotonic() + 60
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in workers), "orphaned workers outlived the convert"


@pytest.mark.slow
def test_sigterm_cleans_up_like_ctrl_c(pair, tmp_path: Path) -> None:
    """SIGTERM while spawned workers write ranks: the workers are stopped, staging removed, exit 128 + 15."""
    out, hold_dir = tmp_path / "work" / "ckpt", tmp_path / "held"
    proc = _start_held(pair, out, hold_dir)
    try:
        _wait_for(lambda: announced(hold_dir), proc, "a worker wrote its rank")
        workers = _spawned_workers(proc.pid)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        err = proc.stderr.read().decode()
    finally:
        proc.stderr.close()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err == "dflash-trt convert: terminated\n"
    assert os.listdir(out.parent) == []
    _assert_gone(workers)


@pytest.mark.slow
def test_killed_parent_takes_its_spawned_workers_along(pair, tmp_path: Path) -> None:
    """Held workers outlive nothing: once the parent is killed the kernel kills them too."""
    proc = _start_held(pair, tmp_path / "ckpt", tmp_path / "held")
    try:
        _wait_for(lambda: announced(tmp_path / "held"), proc, "a worker wrote its rank")
        workers = _spawned_workers(proc.pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        proc.stderr.close()
    _assert_gone(workers)


@pytest.mark.slow
def test_parallel_workers_after_torch_used_threads_finish(pair, tmp_path: Path) -> None:
    """The parent runs a multi-threaded torch op first (OpenMP threads exist), then writes 8 ranks with 2 workers:
    forked workers could deadlock in OpenMP here; spawned ones cannot."""
    script = (
        "import sys, torch; torch.set_num_threads(4); torch.randn(512, 512) @ torch.randn(512, 512); "
        "from dflash_trt.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    out = tmp_path / "ckpt"
    command = [sys.executable, "-c", script, *_convert_command(pair, out, "--workers", "2")[3:]]
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    serial = tmp_path / "serial"
    convert_checkpoint(*pair, serial, tp_size=8)
    for rank in range(8):
        name = f"rank{rank}.safetensors"
        assert (out / name).read_bytes() == (serial / name).read_bytes()


def test_stale_scratch_of_dead_runs_is_removed(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    stale = tmp_path / f".dflash-calibration-{dead_pid}-x1"
    (stale / "checkpoint").mkdir(parents=True)
    (stale / "checkpoint" / "rank0.safetensors").write_bytes(b"\0" * 1024)
    living = tmp_path / f".dflash-calibration-{os.getppid()}-x2"  # a run still going: kept
    living.mkdir()
    other = tmp_path / f".dflash-other-{dead_pid}-x3"  # another purpose: not ours to judge
    other.mkdir()
    with scratch_directory(tmp_path, "calibration") as scratch:
        assert scratch.is_dir() and scratch.name.startswith(f".dflash-calibration-{os.getpid()}-")
        assert not stale.exists() and living.exists() and other.exists()
    assert not scratch.exists()
