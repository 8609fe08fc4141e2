"""Seeded step-by-step arithmetic corpus with a disjoint held-out split.

Every problem has a fixed layout (4-digit zero-padded operands, one line per digit column) so a tiny model
can learn it on a CPU, and the worked steps give the long predictable stretches block drafting relies on.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from dataclasses import dataclass

TASKS = ("add", "sub", "mul", "count")
WIDTH = 4
COUNT_STEPS = 8
HELDOUT_MODULUS = 10  # a problem is held out when the hash of its prompt falls in residue 0


@dataclass(frozen=True)
class Problem:
    """One worked example: `prompt` is what the model is given, `response` what it must write."""

    task: str
    prompt: str
    response: str
    answer: str

    @property
    def text(self) -> str:
        return self.prompt + self.response


def _digits(value: int) -> list[int]:
    """Digits of a WIDTH-wide number, least significant first."""
    return [int(c) for c in reversed(f"{value:0{WIDTH}d}")]


def _add(a: int, b: int) -> Problem:
    lines, carry = [], 0
    for da, db in zip(_digits(a), _digits(b), strict=True):
        total = da + db + carry
        lines.append(f"{da}+{db}+{carry}={total:02d}\n")
        carry = total // 10
    answer = str(a + b)
    return Problem("add", f"add {a:0{WIDTH}d} {b:0{WIDTH}d}\n", "".join(lines) + f"ans {answer}\n", answer)


def _sub(a: int, b: int) -> Problem:
    a, b = max(a, b), min(a, b)
    lines, borrow = [], 0
    for da, db in zip(_digits(a), _digits(b), strict=True):
        diff = da - db - borrow
        borrow_out = int(diff < 0)
        lines.append(f"{da}-{db}-{borrow}={diff + 10 * borrow_out} b{borrow_out}\n")
        borrow = borrow_out
    answer = str(a - b)
    return Problem("sub", f"sub {a:0{WIDTH}d} {b:0{WIDTH}d}\n", "".join(lines) + f"ans {answer}\n", answer)


def _mul(a: int, m: int) -> Problem:
    lines, carry = [], 0
    for da in _digits(a):
        total = da * m + carry
        lines.append(f"{da}*{m}+{carry}={total:02d}\n")
        carry = total // 10
    answer = str(a * m)
    return Problem("mul", f"mul {a:0{WIDTH}d} {m}\n", "".join(lines) + f"ans {answer}\n", answer)


def _count(start: int) -> Problem:
    values = [f"{start + i:0{WIDTH}d}" for i in range(1, COUNT_STEPS + 1)]
    answer = values[-1]
    return Problem("count", f"count {start:0{WIDTH}d}\n", " ".join(values) + f"\nans {answer}\n", answer)


def random_problem(rng: random.Random, task: str) -> Problem:
    """Draw one problem of `task`; operands uniform over their fixed-width range."""
    top = 10**WIDTH - 1
    if task == "add":
        return _add(rng.randint(0, top), rng.randint(0, top))
    if task == "sub":
        return _sub(rng.randint(0, top), rng.randint(0, top))
    if task == "mul":
        return _mul(rng.randint(0, top), rng.randint(2, 9))
    if task == "count":
        return _count(rng.randint(0, top - COUNT_STEPS))
    raise ValueError(f"unknown task {task!r}")


def is_heldout(problem: Problem) -> bool:
    """Split by a hash of the prompt, so train and held-out never share a problem whatever the seed."""
    digest = hashlib.sha256(problem.prompt.encode()).digest()
    return int.from_bytes(digest[:4], "little") % HELDOUT_MODULUS == 0


def generate(seed: int, count: int, heldout: bool) -> Iterator[Problem]:
    """`count` problems cycling through TASKS, from the train split or the held-out split."""
    rng = random.Random(seed)
    produced = 0
    while produced < count:
        problem = random_problem(rng, TASKS[produced % len(TASKS)])
        if is_heldout(problem) == heldout:
            produced += 1
            yield problem


def corpus_sha256(problems: list[Problem]) -> str:
    """Hash of the training texts, one per line group, as recorded in the manifest."""
    digest = hashlib.sha256()
    for problem in problems:
        digest.update(problem.text.encode())
        digest.update(b"\0")
    return digest.hexdigest()
