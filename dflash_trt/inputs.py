"""The rules for the values users type, in one place for every way they arrive.

A rule checks a value already parsed (a YAML or JSON field, named in the message) and, called on a string, is an
argparse `type=` (a bad flag is refused by the parser in one line naming the flag). Command-line flags, build
profiles and sweep configs pick their rule here, so a new flag or field is range-checked by construction, and
every refusal says the allowed range. The limits bound every loop and allocation a value sizes.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any

from dflash_trt.draft_schedule import AUTO, FIXED, MAX_STEPS, NONE, DraftLenSchedule
from dflash_trt.errors import DFlashTrtError
from dflash_trt.sampling_rules import MAX_SEED, TEMPERATURE_RULE, temperature_refusal

# Requests one benchmark point may send (warm-up included): each one is held in memory with its timings.
MAX_REQUESTS = 1_000_000
# Closed-loop users at one point; each is a thread-free slot, but a million idle ones only waste memory.
MAX_CONCURRENCY = 65_536
# Open-loop arrival rate, requests per second.
MAX_REQUEST_RATE = 1e6
# A point's time limit: one week.
MAX_TIMEOUT_S = 7 * 24 * 3600.0
# Token ids and vocabulary sizes fit TensorRT-LLM's int32 tensors.
MAX_TOKEN_ID = 2**31 - 1
MAX_GPUS = 1024
# Nodes of a draft tree: the tree search ranks up to N² candidates per draft position.
MAX_DRAFT_TREE = 4096


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _refuse(name: str, rule: str, value: object) -> DFlashTrtError:
    return DFlashTrtError(f"{name} must be {rule}, got {_shown(value)}")


class _Rule:
    """A check of a parsed value (`check`) that doubles as an argparse `type=` (called on the flag's text)."""

    def describe(self) -> str:
        raise NotImplementedError

    def check(self, value: Any, name: str) -> Any:
        raise NotImplementedError

    def parse(self, text: str) -> Any:
        raise NotImplementedError

    def __call__(self, text: str) -> Any:
        try:
            return self.check(self.parse(text), "the value")
        except (ValueError, OverflowError, DFlashTrtError):
            raise argparse.ArgumentTypeError(f"must be {self.describe()}, got {_shown(text)}") from None


@dataclass(frozen=True)
class IntRange(_Rule):
    """An integer in [lo, hi]; booleans are not integers here (`max_batch_size: true` is refused, not 1)."""

    lo: int
    hi: int

    def describe(self) -> str:
        return f"an integer in [{self.lo}, {self.hi}]"

    def parse(self, text: str) -> int:
        return int(text.strip())

    def check(self, value: Any, name: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not self.lo <= value <= self.hi:
            raise _refuse(name, self.describe(), value)
        return value


@dataclass(frozen=True)
class FloatRange(_Rule):
    """A finite number in [lo, hi], or in (lo, hi] when `above_lo`."""

    lo: float
    hi: float
    above_lo: bool = False

    def describe(self) -> str:
        return f"a finite number in {'(' if self.above_lo else '['}{self.lo:g}, {self.hi:g}]"

    def parse(self, text: str) -> float:
        return float(text)

    def check(self, value: Any, name: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _refuse(name, self.describe(), value)
        number = float(value)
        low_ok = number > self.lo if self.above_lo else number >= self.lo
        if not math.isfinite(number) or not low_ok or number > self.hi:
            raise _refuse(name, self.describe(), value)
        return number


@dataclass(frozen=True)
class ListOf(_Rule):
    """A non-empty list of values of one rule without repeats; on the command line, comma-separated."""

    item: IntRange | FloatRange

    def describe(self) -> str:
        return f"a comma-separated list of distinct values, each {self.item.describe()}"

    def parse(self, text: str) -> list:
        return [self.item.parse(part) for part in text.split(",")]

    def check(self, value: Any, name: str) -> list:
        rule = f"a non-empty list of distinct values, each {self.item.describe()}"
        if not isinstance(value, list) or not value:
            raise _refuse(name, rule, value)
        try:
            checked = [self.item.check(v, name) for v in value]
        except DFlashTrtError:
            raise _refuse(name, rule, value) from None
        if len(set(checked)) != len(checked):
            raise _refuse(name, rule, value)
        return checked


@dataclass(frozen=True)
class HostPort(_Rule):
    """`HOST:PORT` with a port in [1, 65535] (gRPC would silently wrap 99999 to 34463)."""

    def describe(self) -> str:
        return "HOST:PORT with a port in [1, 65535]"

    def parse(self, text: str) -> str:
        return text

    def check(self, value: Any, name: str) -> str:
        if not isinstance(value, str):
            raise _refuse(name, self.describe(), value)
        host, sep, port = value.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise _refuse(name, self.describe(), value)
        return value.strip()


@dataclass(frozen=True)
class DraftLenScheduleRule(_Rule):
    """`auto`, `none` or `N1:K1,N2:K2,...`: with at least N requests in a step, draft K tokens (draft_schedule.py).
    Parses to `AUTO` (the planner derives the table later) or a `DraftLenSchedule`; whether K fits the drafter's
    block is checked once the block is known (`DraftLenSchedule.fitted_to`)."""

    def describe(self) -> str:
        return (
            f"{AUTO}, {NONE} or N1:K1,N2:K2,... (at most {MAX_STEPS} steps; request counts N strictly ascending, "
            f"draft lengths K non-increasing, each an integer in [1, {MAX_TOKEN_ID}])"
        )

    def parse(self, text: str) -> str:
        return text

    def check(self, value: Any, name: str) -> DraftLenSchedule | str:
        if isinstance(value, DraftLenSchedule):
            return value
        if not isinstance(value, str):
            raise _refuse(name, self.describe(), value)
        text = value.strip()
        if text == AUTO:
            return AUTO
        if text == NONE:
            return FIXED
        steps = []
        for part in text.split(","):
            load, sep, length = (p.strip() for p in part.partition(":"))
            if not sep or not all(t.isascii() and t.isdigit() for t in (load, length)):
                raise _refuse(name, self.describe(), value)
            if not (1 <= int(load) <= MAX_TOKEN_ID and 1 <= int(length) <= MAX_TOKEN_ID):
                raise _refuse(name, self.describe(), value)
            steps.append((int(load), int(length)))
        try:
            return DraftLenSchedule(tuple(steps))
        except DFlashTrtError:
            raise _refuse(name, self.describe(), value) from None


@dataclass(frozen=True)
class Temperature(_Rule):
    """A sampling temperature the engine can honour, by `sampling_rules`' rule."""

    def describe(self) -> str:
        return TEMPERATURE_RULE

    def parse(self, text: str) -> float:
        return float(text)

    def check(self, value: Any, name: str) -> float:
        if temperature_refusal(value) is not None:
            raise _refuse(name, self.describe(), value)
        return float(value)


def available_memory_bytes() -> int | None:
    """Memory this machine can still hand out, page cache included (Linux's MemAvailable); None where the OS does
    not say, and then nothing is refused."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_fits_in_memory(nbytes: int, what: str, advice: str) -> None:
    """Refuse before allocating what cannot fit in this machine's free memory (not after a MemoryError or the OOM
    killer half-way through a run)."""
    free = available_memory_bytes()
    if free is not None and nbytes > free:
        raise DFlashTrtError(
            f"{what} would need {nbytes / 2**30:.1f} GiB, more than the {free / 2**30:.1f} GiB of memory free; {advice}"
        )


def check_bool(value: Any, name: str) -> bool:
    """Only true or false (YAML's `"false"` is a non-empty string, which `bool()` would make true)."""
    if not isinstance(value, bool):
        raise _refuse(name, "true or false", value)
    return value


def check_text(value: Any, name: str) -> str:
    """A non-empty string (a path or a name); numbers are not silently turned into paths."""
    if not isinstance(value, str) or not value.strip():
        raise _refuse(name, "a non-empty string", value)
    return value


POSITIVE_INT = IntRange(1, MAX_TOKEN_ID)
REQUESTS = IntRange(1, MAX_REQUESTS)
WARMUP = IntRange(0, MAX_REQUESTS)
CONCURRENCY = IntRange(1, MAX_CONCURRENCY)
CONCURRENCIES = ListOf(CONCURRENCY)
REQUEST_RATES = ListOf(FloatRange(0.0, MAX_REQUEST_RATE, above_lo=True))
TIMEOUT_S = FloatRange(0.0, MAX_TIMEOUT_S, above_lo=True)
GPUS = IntRange(1, MAX_GPUS)
WORKERS = IntRange(1, MAX_GPUS)  # parallel processes, one per rank at most
SPEED = FloatRange(0.0, 1e9, above_lo=True)  # tok/s/user
SPEED_LEVELS = ListOf(SPEED)  # tok/s/user values of a speedup table
TOKEN_ID = IntRange(0, MAX_TOKEN_ID)
END_ID = IntRange(-1, MAX_TOKEN_ID)  # TensorRT-LLM's end id; -1 matches no token (requests run to their budget)
VOCAB_SIZE = IntRange(1, MAX_TOKEN_ID)
SEED = IntRange(0, MAX_SEED)
DRAFT_TREE = IntRange(1, MAX_DRAFT_TREE)  # nodes per draft tree; block_size - 1 is the chain
TEMPERATURE = Temperature()
TOP_P = FloatRange(0.0, 1.0, above_lo=True)
TOP_K = IntRange(0, MAX_TOKEN_ID)
MEMORY_FRACTION = FloatRange(0.0, 1.0, above_lo=True)
URL = HostPort()
PORT = IntRange(0, 65535)  # 0: any free port
DRAFT_LEN_SCHEDULE = DraftLenScheduleRule()


def draft_tree_nodes(nodes: int | None, num_drafts: int, dflash2: bool, what: str = "--draft_tree") -> int:
    """Nodes per draft tree for `nodes` (0: the chain, for none or `nodes` = the drafter's `num_drafts`): refuses
    fewer nodes than the chain, and a drafter whose drafts are not independent per position (DFlash2's selector walks
    one chain). The golden loop and the engine ask this one rule."""
    if nodes is None or nodes == num_drafts:
        return 0
    if nodes < num_drafts:
        raise DFlashTrtError(
            f"{what} {nodes}: a tree holds at least the chain's {num_drafts} drafts (block_size - 1); shorter drafts "
            "are a draft length, not a tree"
        )
    if dflash2:
        raise DFlashTrtError(
            "draft trees need the drafter's per-position distributions; a DFlash2 drafter's selector walks one chain"
        )
    return nodes
