"""Every TensorRT-LLM / TensorRT symbol and keyword our engine code uses is one we read in the 1.2.x sources.

TensorRT-LLM cannot be installed here, so the engine code cannot run in CI. Instead each symbol it touches is
recorded in tests/data/trtllm_api.json with the file it was read from and its signature there; this test walks the
code (AST) and fails on a use that is not recorded, on a keyword argument the recorded signature does not accept, and
on a recorded symbol nothing uses any more.
"""

from __future__ import annotations

import ast
import json
import py_compile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "dflash_trt" / "trtllm"
API = json.loads((ROOT / "tests" / "data" / "trtllm_api.json").read_text())
EXTERNAL = ("tensorrt_llm", "tensorrt")
# The build plan and the modules it is made of: `dflash-trt build --dry_run`, profiles and the emulation use them.
PLAN_MODULES = (
    "build_plan.py",
    "build_limits.py",
    "build_settings.py",
    "checkpoint_facts.py",
    "eagle_layout.py",
    "inverse_cdf.py",
    "network_environment.py",
    "engine_lengths.py",
    "network_checks.py",
    "attention_checks.py",
    "settings_checks.py",
    "trtllm_build_command.py",
    "engine_manifest.py",
)


def sources() -> list[Path]:
    """The engine package plus the executor backend that drives engines (selftest and bench go through it)."""
    return [*sorted(PACKAGE.glob("*.py")), ROOT / "dflash_trt" / "executors" / "trtllm.py"]


def aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> dotted external name, for every import of tensorrt / tensorrt_llm anywhere in the module."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in EXTERNAL:
                    names[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in EXTERNAL:
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def dotted(node: ast.AST, names: dict[str, str]) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in names:
        return ".".join([names[node.id], *reversed(parts)])
    return None


def uses(path: Path) -> tuple[set[str], list[tuple[str, str, int]]]:
    """(external symbols referenced, (symbol, keyword, line) of every keyword argument passed to one)."""
    tree = ast.parse(path.read_text())
    names = aliases(tree)
    symbols, keywords = set(), []
    # Inner links of a chain (`trt.PluginFieldType` in `trt.PluginFieldType.INT32`) are not uses of their own.
    inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Attribute, ast.Name)) and id(node) not in inner:
            name = dotted(node, names)
            if name is not None:
                symbols.add(name)
        if isinstance(node, ast.Call):
            name = dotted(node.func, names)
            if name is not None:
                keywords += [(name, kw.arg, node.lineno) for kw in node.keywords if kw.arg is not None]
    return symbols, keywords


def parameters(signature: str) -> tuple[set[str], bool]:
    """Parameter names of a recorded signature and whether it takes **kwargs."""
    func = ast.parse(f"def {signature.split(' -> ')[0]}: pass").body[0]
    args = func.args
    params = {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}
    return params, args.kwarg is not None


def all_uses() -> tuple[set[str], list[tuple[str, str, int, str]]]:
    symbols, keywords = set(), []
    for path in sources():
        found, kws = uses(path)
        symbols |= found
        keywords += [(s, k, line, path.name) for s, k, line in kws]
    return symbols, keywords


def test_every_external_symbol_is_recorded():
    symbols, _ = all_uses()
    missing = sorted(symbols - set(API["symbols"]))
    assert not missing, f"used but not recorded in tests/data/trtllm_api.json: {missing}"


def test_no_stale_records():
    symbols, _ = all_uses()
    stale = sorted(set(API["symbols"]) - symbols)
    assert not stale, f"recorded but no longer used: {stale}"


def test_keywords_match_the_recorded_signatures():
    _, keywords = all_uses()
    wrong = []
    for symbol, keyword, line, file in keywords:
        record = API["symbols"].get(symbol)
        if record is None:
            continue  # reported by test_every_external_symbol_is_recorded
        if "signature" not in record:
            wrong.append(f"{file}:{line} {symbol} is called with keywords but has no recorded signature")
            continue
        params, open_kwargs = parameters(record["signature"])
        if keyword not in params and not open_kwargs:
            wrong.append(f"{file}:{line} {symbol}(... {keyword}=)")
    assert not wrong, f"keywords the 1.2.x signature does not have: {wrong}"


def test_records_name_their_source():
    for symbol, record in API["symbols"].items():
        assert symbol.split(".")[0] in EXTERNAL
        assert record.get("source"), symbol
        if "signature" in record:
            parameters(record["signature"])  # must parse


def test_walk_sees_what_it_should(tmp_path: Path):
    """The checker itself: a made-up module's uses and keywords are found (so an empty result means none)."""
    module = tmp_path / "m.py"
    module.write_text(
        "import tensorrt as trt\n"
        "from tensorrt_llm.functional import concat as cat\n"
        "def f(x):\n"
        "    return cat([x], dim=0, bogus=1), trt.PluginFieldType.INT32\n"
    )
    symbols, keywords = uses(module)
    assert symbols == {"tensorrt_llm.functional.concat", "tensorrt.PluginFieldType.INT32"}
    assert [(s, k) for s, k, _ in keywords] == [
        ("tensorrt_llm.functional.concat", "dim"),
        ("tensorrt_llm.functional.concat", "bogus"),
    ]
    params, open_kwargs = parameters("concat(inputs: Sequence[Union[Tensor, int]], dim: int = 0) -> Tensor")
    assert params == {"inputs", "dim"} and not open_kwargs


@pytest.mark.parametrize("path", sources(), ids=lambda p: p.name)
def test_engine_modules_compile(path: Path, tmp_path: Path):
    """No TensorRT-LLM here, but every module must at least be valid Python for the supported interpreters."""
    py_compile.compile(str(path), cfile=str(tmp_path / "out.pyc"), doraise=True)


def test_pure_modules_do_not_import_tensorrt_at_module_level():
    """The build plan and its modules (used on CPU machines) and build must not need TensorRT-LLM to import."""
    for name in (*PLAN_MODULES, "build.py", "__init__.py"):
        tree = ast.parse((PACKAGE / name).read_text())
        top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        assert not aliases(ast.Module(body=top, type_ignores=[])), name


def test_planned_command_uses_only_flags_trtllm_build_accepts(converted: Path, tmp_path: Path):
    """Every flag dflash-trt build puts on the trtllm-build command line exists in 1.2.x's argument parser."""
    from dflash_trt.trtllm.build_plan import plan_engine_build
    from dflash_trt.trtllm.build_settings import EngineBuildSettings

    plan = plan_engine_build(converted, tmp_path / "e", EngineBuildSettings(max_seq_len=256, max_input_len=128))
    used = {arg for arg in plan.command if arg.startswith("--")}
    assert used <= set(API["trtllm_build_flags"]), used - set(API["trtllm_build_flags"])
