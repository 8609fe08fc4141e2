"""No function in dflash_trt/ runs over MAX_LINES lines: a longer one hides its steps, so it is split into named ones.

Lengths are counted with `ast` from a function's `def` line to its last line, docstring and nested functions
included (decorators are not).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 80


def function_lengths(path: Path, root: Path = ROOT) -> list[tuple[str, int]]:
    """(`file:line name`, lines) of every function and method of one file, the file named from `root`."""
    tree = ast.parse(path.read_text(), str(path))
    where = path.relative_to(root).as_posix()
    return [
        (f"{where}:{node.lineno} {node.name}", node.end_lineno - node.lineno + 1)
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno is not None
    ]


def test_the_walk_measures_what_it_should(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    lines = ["def short():", "    return 1", "", "", "class A:", "    @staticmethod", "    def method():"]
    sample.write_text("\n".join([*lines, "        x = 1", "        return x", ""]))
    assert sorted(function_lengths(sample, tmp_path)) == [("sample.py:1 short", 2), ("sample.py:7 method", 3)]


def test_no_function_is_over_the_limit() -> None:
    lengths = [row for path in sorted((ROOT / "dflash_trt").rglob("*.py")) for row in function_lengths(path)]
    assert len(lengths) > 1000  # the walk sees the code base, not an empty tree
    assert [f"{name}: {n} lines" for name, n in lengths if n > MAX_LINES] == []
