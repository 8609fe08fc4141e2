"""Tensor-parallel ranks in lockstep: one thread per rank network, and the collectives of 1.2.x `functional.py`
(`allreduce`, `allgather`) that the stand-in layers call where the real ones would.

Every rank builds and runs its own network over its own `rank{N}.safetensors`; a collective blocks until every rank
of the group has reached it, exactly as NCCL (or the custom all-reduce plugin) does on a GPU. An all-reduce sums
the ranks' tensors and hands every rank the same sum, as the custom all-reduce kernels add: from zero, rank 0 first,
one addition at a time in the tensors' own dtype, so a half-precision sum is rounded after every rank [read:
customAllReduceKernels.cu `oneShotAllReduceKernel` / `twoShotAllReduceKernel`, "Always reduce from rank 0",
`add128b` in the element type; not run]. NCCL, which 1.2.x picks for large messages, also sums in the dtype but in
an order of its own. An all-gather concatenates in rank order along `gather_dim`. A rank that fails aborts the
group, so no rank waits forever.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from dflash_trt.emulation.functional import EmulationError, Tensor, wrap_tensor

T = TypeVar("T")
_running = threading.local()


class RankGroup:
    """The `size` ranks of one tensor-parallel group and the rendezvous their collectives share."""

    def __init__(self, size: int):
        self.size = size
        self._barrier = threading.Barrier(size)
        self._slots: list[torch.Tensor | None] = [None] * size

    def _exchange(self, rank: int, value: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's tensor of this collective, in rank order (all ranks must call it, in the same order)."""
        self._slots[rank] = value
        self._barrier.wait()
        values = [v for v in self._slots if v is not None]
        self._barrier.wait()
        if len(values) != self.size:
            raise EmulationError("a collective was not reached by every rank")
        return values

    def run(self, work: Sequence[Callable[[], T]]) -> list[T]:
        """`work[r]` on rank r's thread, all at once; every result, or the first rank's error."""
        if len(work) != self.size:
            raise EmulationError(f"{len(work)} rank networks for a group of {self.size}")
        results: list[Any] = [None] * self.size
        errors: list[BaseException | None] = [None] * self.size

        def body(rank: int) -> None:
            _running.group, _running.rank = self, rank
            try:
                results[rank] = work[rank]()
            except BaseException as exc:  # re-raised on the caller's thread below
                errors[rank] = exc
                self._barrier.abort()

        threads = [threading.Thread(target=body, args=(r,), name=f"rank{r}") for r in range(self.size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self._barrier.reset()
        first = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)), None)
        if first is not None or any(errors):
            raise first or EmulationError("a rank left a collective")
        return results


def _current(group: Any) -> tuple[RankGroup, int]:
    running: RankGroup | None = getattr(_running, "group", None)
    if running is None:
        raise EmulationError("a collective outside a rank group (tp_size > 1 networks run through RankGroup.run)")
    if list(group) != list(range(running.size)):
        raise EmulationError(f"collective over group {list(group)}, the running group is ranks 0..{running.size - 1}")
    return running, _running.rank


def allreduce(tensor: Tensor, group: Any, all_reduce_params: Any = None) -> Tensor:
    """Sum over the group's ranks; every rank gets the same tensor (functional.py `allreduce`, op SUM)."""
    running, rank = _current(group)
    values = running._exchange(rank, tensor.data)
    total = torch.zeros_like(values[0])
    for value in values:
        total = total + value
    return wrap_tensor(total)


def allgather(tensor: Tensor, group: Any, gather_dim: int = 0) -> Tensor:
    """Concatenation of the ranks' tensors along `gather_dim` in rank order (functional.py `allgather`)."""
    running, rank = _current(group)
    return wrap_tensor(torch.cat(running._exchange(rank, tensor.data), dim=gather_dim))
