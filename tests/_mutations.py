"""Deliberate mutations of the engine network's sources (`dflash_trt/trtllm/{plugin,verify,model}.py`), executed under
the emulation's stand-ins exactly as the unmodified sources are (`emulation/stand_ins.py`). A test that installs one
must see the emulated engine fail or diverge from the golden model: otherwise the tests cannot tell the network from a
broken one."""

from __future__ import annotations

import types
from pathlib import Path

from dflash_trt.emulation import plugins, stand_ins


def mutated_engine_module(tmp_path: Path, source: str, old: str, new: str) -> types.ModuleType:
    """The engine's model module with `old` replaced by `new` (exactly once) in `<source>.py`."""
    names = tuple(f"dflash_trt.trtllm.{s}" for s in stand_ins.ENGINE_SOURCES)
    text = (stand_ins.ENGINE_PACKAGE / f"{source}.py").read_text()
    assert text.count(old) == 1, f"the mutation's anchor is not unique in {source}.py: {old!r}"
    paths = {}
    for name in names:
        short = name.rpartition(".")[2]
        paths[name] = tmp_path / f"{short}.py"
        paths[name].write_text(
            text.replace(old, new) if short == source else (stand_ins.ENGINE_PACKAGE / f"{short}.py").read_text()
        )
    with stand_ins.stand_ins_installed(names):
        fresh = {name: stand_ins._exec_source(name, paths[name]) for name in names}
    setattr(fresh["dflash_trt.trtllm.plugin"], "load_plugin_library", plugins.load_emulated_plugin_library)  # noqa: B010
    return fresh["dflash_trt.trtllm.model"]


def install(monkeypatch, module: types.ModuleType) -> None:
    """Every emulated engine built from now on (until the test ends) runs `module`'s network."""
    stand_ins.load_engine_module()  # the unmodified sources first, so that only the model is replaced
    monkeypatch.setitem(stand_ins._engine_modules, "model", module)
