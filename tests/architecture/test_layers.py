"""Packages import only downward, in the order written once in docs/architecture.md (the `layers` block).

Every `import` and `from ... import` in dflash_trt/ counts, function-level and TYPE_CHECKING imports included.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "dflash_trt"
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def read_layers(text: str) -> dict[str, int]:
    """Unit ('name/' package or 'name.py' module) -> layer height; the block lists the top layer first."""
    block = re.search(r"^```layers\n(.*?)^```", text, re.S | re.M)
    assert block, "docs/architecture.md has no ```layers block"
    rows = [line.split() for line in block.group(1).splitlines() if line.strip()]
    return {unit: len(rows) - i for i, (_, *units) in enumerate(rows) for unit in units}


@dataclass(frozen=True)
class Edge:
    source: str  # dotted module name
    target: str
    line: int


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__.py"
    if (PACKAGE / parts[1]).is_dir():
        return parts[1] + "/"
    return parts[1] + ".py"


def is_module(dotted: str) -> bool:
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports(path: Path) -> list[Edge]:
    """Internal imports of one file, as the modules they load (`from a import b` loads a.b when b is a module)."""
    source = module_name(path)
    package = source if path.name == "__init__.py" else source.rpartition(".")[0]
    edges = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if is_module(f"{base}.{a.name}") else base for a in node.names]
        else:
            continue
        edges += [Edge(source, t, node.lineno) for t in targets if t.split(".")[0] == "dflash_trt"]
    return edges


def violations(edges: list[Edge], layers: dict[str, int]) -> list[str]:
    bad = []
    for e in edges:
        a, b = unit(e.source), unit(e.target)
        if a == b:
            continue
        same_layer_modules = layers[a] == layers[b] and a.endswith(".py") and b.endswith(".py")
        if layers[b] < layers[a] or same_layer_modules:
            continue
        kind = "sideways" if layers[a] == layers[b] else "upward"
        bad.append(f"{e.source}:{e.line} imports {e.target} ({kind}: {a} -> {b})")
    return bad


def package_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_unit_has_exactly_one_layer() -> None:
    layers = read_layers(ARCHITECTURE.read_text())
    present = {unit(module_name(p)) for p in package_files()}
    assert not present - set(layers), f"add these to the layers block of docs/architecture.md: {present - set(layers)}"
    assert not set(layers) - present, f"the layers block lists units that do not exist: {set(layers) - present}"


def test_packages_import_only_downward() -> None:
    layers = read_layers(ARCHITECTURE.read_text())
    edges = [e for p in package_files() for e in imports(p)]
    assert len(edges) > 100  # the walk sees the code base, not an empty tree
    assert violations(edges, layers) == []


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("from dflash_trt.analysis.model import X", "upward: checkpoint/ -> analysis/"),
        ("def f():\n    import dflash_trt.triton.repository", "upward: checkpoint/ -> triton/"),
        ("from dflash_trt import cli", "upward: checkpoint/ -> cli.py"),
        ("from ..conversion import convert", "upward: checkpoint/ -> conversion/"),
    ],
)
def test_an_upward_import_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: str, expected: str):
    fake_root = tmp_path / "repo"
    (fake_root / "dflash_trt" / "checkpoint").mkdir(parents=True)
    for sub in ("analysis", "triton", "conversion"):
        (fake_root / "dflash_trt" / sub).mkdir()
        (fake_root / "dflash_trt" / sub / "__init__.py").write_text("")
    for leaf in ("analysis/model.py", "triton/repository.py", "conversion/convert.py", "cli.py"):
        (fake_root / "dflash_trt" / leaf).write_text("")
    offender = fake_root / "dflash_trt" / "checkpoint" / "bad.py"
    offender.write_text(code + "\n")
    monkeypatch.setitem(globals(), "ROOT", fake_root)
    monkeypatch.setitem(globals(), "PACKAGE", fake_root / "dflash_trt")
    layers = read_layers(ARCHITECTURE.read_text())
    (report,) = violations(imports(offender), layers)
    assert report.endswith(f"({expected})")


def test_a_sideways_import_between_sibling_packages_is_reported() -> None:
    layers = read_layers(ARCHITECTURE.read_text())
    edge = Edge("dflash_trt.quant.fp8", "dflash_trt.tiny.corpus", 3)
    assert violations([edge], layers) == [
        "dflash_trt.quant.fp8:3 imports dflash_trt.tiny.corpus (sideways: quant/ -> tiny/)"
    ]
    # Top-level modules of one layer may use each other (spec.py reads JSON through jsonfile.py).
    assert violations([Edge("dflash_trt.spec", "dflash_trt.jsonfile", 1)], layers) == []


def package_circles(edges: list[Edge]) -> list[list[str]]:
    """Import circles between modules of one package (a lazy import hides a circle; it does not remove it)."""
    graph: dict[str, set[str]] = {}
    for e in edges:
        if e.source != e.target and unit(e.source) == unit(e.target) and unit(e.source).endswith("/"):
            graph.setdefault(e.source, set()).add(e.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def private_imports(path: Path) -> list[str]:
    """`from m import _name` where m is another dflash_trt module: a private name used as another module's contract."""
    edges = {e.line: e for e in imports(path)}
    bad = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.lineno in edges:
            private = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
            bad += [f"{module_name(path)}:{node.lineno} imports {name}" for name in private]
    return bad


def test_no_module_circle_inside_a_package() -> None:
    edges = [e for p in package_files() for e in imports(p)]
    assert package_circles(edges) == []


def test_a_module_circle_is_reported() -> None:
    lazy = [
        Edge("dflash_trt.emulation.a", "dflash_trt.emulation.b", 1),
        Edge("dflash_trt.emulation.b", "dflash_trt.emulation.a", 9),
    ]
    assert package_circles(lazy) == [["dflash_trt.emulation.a", "dflash_trt.emulation.b"]]
    assert package_circles(lazy[:1]) == []


def test_no_private_name_is_imported_across_modules() -> None:
    assert [bad for p in package_files() for bad in private_imports(p)] == []


def test_a_private_import_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_root = tmp_path / "repo"
    (fake_root / "dflash_trt" / "quant").mkdir(parents=True)
    (fake_root / "dflash_trt" / "quant" / "__init__.py").write_text("")
    (fake_root / "dflash_trt" / "quant" / "fp8.py").write_text("")
    offender = fake_root / "dflash_trt" / "quant" / "nvfp4.py"
    offender.write_text("from dflash_trt import __version__\nfrom .fp8 import _round, public\n")
    monkeypatch.setitem(globals(), "ROOT", fake_root)
    monkeypatch.setitem(globals(), "PACKAGE", fake_root / "dflash_trt")
    assert private_imports(offender) == ["dflash_trt.quant.nvfp4:2 imports _round"]
