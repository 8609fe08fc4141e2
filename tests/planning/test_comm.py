"""Collectives priced from published kernel measurements: the one-shot table, the NCCL line, the runtimes'
switch between them, and another link generation."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_trt.analysis import comm
from dflash_trt.analysis.comm import INTERCONNECTS, allgather_seconds, allreduce_seconds, nccl_fit, oneshot_seconds

HOPPER, BLACKWELL = INTERCONNECTS["nvlink4"], INTERCONNECTS["nvlink5"]


def test_oneshot_reads_the_published_table_and_interpolates_linearly():
    # SGLang PR #2904, TP 8: 7.8 us at 128 KiB (32768 float32 elements), 16.7 us at 1 MiB.
    assert oneshot_seconds(8, 131072) == pytest.approx(7.8e-6)
    assert oneshot_seconds(8, 1048576) == pytest.approx(16.7e-6)
    midway = (131072 + 1048576) / 2
    assert oneshot_seconds(8, midway) == pytest.approx((7.8e-6 + 16.7e-6) / 2)
    assert oneshot_seconds(2, 64) == pytest.approx(3.7e-6)  # below the smallest size: its latency
    # Beyond 4 MiB the last measured slope (33.8 - 22.1 us over 2 MiB) continues.
    assert oneshot_seconds(8, 6 * 2**20) == pytest.approx((33.8 + (33.8 - 22.1)) * 1e-6)
    # TP widths between the measured ones take the next wider one; beyond 8, the 8-GPU curve.
    assert oneshot_seconds(3, 16384) == oneshot_seconds(4, 16384)
    assert oneshot_seconds(16, 16384) == oneshot_seconds(8, 16384)


def test_nccl_line_is_the_least_squares_fit_of_the_published_points():
    mb, ms = np.array(comm.NCCL_POINTS_MB_MS).T
    slope, intercept = np.polyfit(mb * 1e6, ms * 1e-3, 1)
    latency, efficiency = nccl_fit()
    assert latency == pytest.approx(intercept)
    # slope = 2 (tp - 1) / tp / (efficiency x 450 GB/s) at the measured TP 6
    assert efficiency == pytest.approx((2 * 5 / 6) / (slope * 450e9))


def test_tensorrt_llm_switches_to_nccl_by_size_and_the_custom_runtimes_do_not():
    latency, efficiency = nccl_fit()
    below, above = 499_999, 500_000
    assert allreduce_seconds(HOPPER, 8, below) == pytest.approx(oneshot_seconds(8, below))
    nccl = latency + 2 * 7 / 8 * above / (efficiency * 450e9)
    assert allreduce_seconds(HOPPER, 8, above) == pytest.approx(nccl)
    assert allreduce_seconds(HOPPER, 8, above, "custom") == pytest.approx(oneshot_seconds(8, above))
    # TP 4 switches at 1 MB, TP 2 never (read in AllreducePlugin::selectImplementation).
    assert allreduce_seconds(HOPPER, 4, 900_000) == pytest.approx(oneshot_seconds(4, 900_000))
    assert allreduce_seconds(HOPPER, 2, 4 * 2**20) == pytest.approx(oneshot_seconds(2, 4 * 2**20))
    assert allreduce_seconds(HOPPER, 1, 1e9) == 0.0 and allgather_seconds(HOPPER, 1, 1e9) == 0.0


def test_a_faster_link_keeps_the_latency_and_moves_bytes_twice_as_fast():
    assert allreduce_seconds(BLACKWELL, 8, 1024) == allreduce_seconds(HOPPER, 8, 1024) == pytest.approx(5.9e-6)
    # NVLink 5 doubles the per-GPU bandwidth: 256 KiB on Blackwell costs what 128 KiB costs on Hopper.
    assert allreduce_seconds(BLACKWELL, 8, 262144) == pytest.approx(allreduce_seconds(HOPPER, 8, 131072))
    latency, efficiency = nccl_fit()
    assert allgather_seconds(BLACKWELL, 8, 8e6) == pytest.approx(latency + 7 / 8 * 8e6 / (efficiency * 900e9))
