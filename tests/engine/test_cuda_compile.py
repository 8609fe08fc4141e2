"""Every CUDA source of the plugin compiles for Hopper and Blackwell; the IPluginV3 glue round-trips on the CPU."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from dflash_trt.rope import RopeConfig
from dflash_trt.trtllm import plugin

PLUGINS = Path(__file__).resolve().parents[2] / "plugins"
CUDA_HOME = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
CU_SOURCES = sorted(PLUGINS.rglob("*.cu"))


@pytest.fixture(scope="module")
def nvcc() -> Path:
    found = shutil.which("nvcc") or (str(CUDA_HOME / "bin" / "nvcc") if (CUDA_HOME / "bin" / "nvcc").exists() else None)
    if found is None:
        pytest.skip("nvcc not found")
    return Path(found)


@pytest.fixture(scope="module")
def archs(nvcc: Path) -> list[int]:
    """sm_90 and sm_100 always; sm_103 (B300) when this nvcc knows it."""
    listed = subprocess.run([nvcc, "--list-gpu-arch"], capture_output=True, text=True, check=True).stdout
    return [90, 100] + ([103] if "compute_103" in listed else [])


@pytest.fixture(scope="module")
def objects(nvcc: Path, archs: list[int], tmp_path_factory: pytest.TempPathFactory) -> dict[Path, Path]:
    out_dir = tmp_path_factory.mktemp("cuda")
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    built = {}
    for source in CU_SOURCES:
        obj = out_dir / (source.stem + ".o")
        cmd = [
            nvcc,
            "-std=c++17",
            "-O3",
            "-Xcompiler=-fPIC,-Wall,-Wextra",
            "-Werror=all-warnings",
            f"-I{PLUGINS / 'include'}",
            *gencode,
            "-c",
            source,
            "-o",
            obj,
        ]
        result = subprocess.run(cmd, capture_output=True, text=True)
        assert result.returncode == 0, f"{source.name} failed for sm {archs}:\n{result.stderr}"
        built[source] = obj
    return built


def test_sources_exist() -> None:
    assert [p.name for p in CU_SOURCES] == ["attentionKernel.cu", "kvInjectionKernel.cu"]


def test_every_cu_compiles_for_hopper_and_blackwell(objects: dict[Path, Path], archs: list[int]) -> None:
    assert {90, 100} <= set(archs)
    for obj in objects.values():
        assert obj.stat().st_size > 0


def test_python_fields_match_plugin_sources() -> None:
    """plugin.py and the C++ creator spell the same field names, plugin name, version and namespace."""
    source = (PLUGINS / "src" / "kvInjectionPlugin.cpp").read_text()
    header = (PLUGINS / "src" / "kvInjectionPlugin.h").read_text()
    cpp_fields = re.findall(r'kField\w+ = "(\w+)"', source)
    geometry = plugin.KVInjectionGeometry(
        num_layers=1,
        num_kv_heads=1,
        head_dim=64,
        layer_idx_offset=0,
        tokens_per_block=32,
        rope=RopeConfig(64, 10000.0),
        eps=1e-6,
    )
    py_fields = plugin.plugin_fields(geometry, type_id=7, cache_fp8=False)
    assert [name for name, _, _ in py_fields] == cpp_fields
    assert f'kKvInjectionPluginName = "{plugin.PLUGIN_NAME}"' in header
    assert f'kKvInjectionPluginVersion = "{plugin.PLUGIN_VERSION}"' in header
    assert f'kDefaultPluginNamespace = "{plugin.PLUGIN_NAMESPACE}"' in (PLUGINS / "src" / "pluginUtils.h").read_text()
    assert "initDflashTrtPlugins" in (PLUGINS / "src" / "exports.map").read_text()


def test_attention_fields_match_plugin_sources() -> None:
    """plugin.py's DFlashAttention fields and the C++ creator's, in order; name, version and namespace too."""
    source = (PLUGINS / "src" / "attentionPlugin.cpp").read_text()
    header = (PLUGINS / "src" / "attentionPlugin.h").read_text()
    cpp_fields = re.findall(r'kField\w+ = "(\w+)"', source)
    geometry = plugin.AttentionGeometry(
        num_heads=8,
        num_kv_heads=2,
        head_dim=128,
        layer_idx=3,
        tokens_per_block=32,
        max_query_len=16,
        causal=False,
        window=None,
        max_positions=4096,
    )
    py_fields = plugin.attention_plugin_fields(geometry, type_id=7, cache_fp8=False)
    assert [name for name, _, _ in py_fields] == cpp_fields
    assert f'kAttentionPluginName = "{plugin.ATTENTION_PLUGIN_NAME}"' in header
    assert f'kAttentionPluginVersion = "{plugin.PLUGIN_VERSION}"' in header


def test_plugin_glue_round_trip_against_tensorrt_headers(objects: dict[Path, Path], tmp_path: Path) -> None:
    """Needs TensorRT 10.x headers (TENSORRT_ROOT/include); links without libnvinfer and runs without a GPU."""
    root = os.environ.get("TENSORRT_ROOT")
    if not root or not (Path(root) / "include" / "NvInferRuntime.h").is_file():
        pytest.skip("set TENSORRT_ROOT to a TensorRT 10.x prefix with include/ to check the IPluginV3 glue")
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("g++ not found")
    exe = tmp_path / "plugin_round_trip"
    kernels = [str(objects[PLUGINS / "src" / name]) for name in ("kvInjectionKernel.cu", "attentionKernel.cu")]
    cmd = [
        compiler,
        "-std=c++17",
        "-O1",
        "-Wall",
        "-Wextra",
        "-Werror",
        f"-I{PLUGINS / 'include'}",
        f"-I{PLUGINS / 'src'}",
        "-isystem",
        f"{root}/include",
        "-isystem",
        str(CUDA_HOME / "include"),
        str(PLUGINS / "tests" / "pluginRoundTrip.cpp"),
        str(PLUGINS / "src" / "kvInjectionPlugin.cpp"),
        str(PLUGINS / "src" / "attentionPlugin.cpp"),
        str(PLUGINS / "src" / "pluginRegistration.cpp"),
        *kernels,
        f"-L{CUDA_HOME / 'lib64'}",
        "-lcudart_static",
        "-ldl",
        "-lpthread",
        "-lrt",
        "-o",
        str(exe),
    ]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    result = subprocess.run([exe], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "OK", result.stdout + result.stderr


def test_plugin_fields_carry_the_rope_table_and_refuse_bad_geometry() -> None:
    from dflash_trt.errors import DFlashTrtError
    from dflash_trt.rope import inv_freq_and_scale

    rope = RopeConfig(128, 1_000_000.0, "yarn", factor=4.0, original_max_position_embeddings=32768)

    def fields_of(head_dim: int, tokens_per_block: int) -> list:
        geometry = plugin.KVInjectionGeometry(
            num_layers=2,
            num_kv_heads=8,
            head_dim=head_dim,
            layer_idx_offset=36,
            tokens_per_block=tokens_per_block,
            rope=rope,
            eps=1e-6,
        )
        return plugin.plugin_fields(geometry, type_id=7, cache_fp8=True)

    fields = {name: value for name, value, _ in fields_of(128, 64)}
    inv_freq, scaling = inv_freq_and_scale(rope)
    assert fields["rope_inv_freq"].tolist() == inv_freq.tolist()
    assert fields["rope_attention_scaling"].tolist() == [pytest.approx(scaling)] and scaling != 1.0
    assert fields["cache_fp8"].tolist() == [1] and fields["layer_idx_offset"].tolist() == [36]
    with pytest.raises(DFlashTrtError, match="head_dim"):
        fields_of(64, 64)
    with pytest.raises(DFlashTrtError, match="power of two"):
        fields_of(128, 48)


def test_loader_reports_a_missing_library(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dflash_trt.errors import DFlashTrtError

    missing = tmp_path / "libdflash_trt_plugins.so"
    monkeypatch.setenv(plugin.LIBRARY_ENV, str(missing))
    assert plugin.default_library_path() == missing
    with pytest.raises(DFlashTrtError, match="not found"):
        plugin.load_plugin_library()
    not_a_library = tmp_path / "garbage.so"
    not_a_library.write_bytes(b"not an ELF file")
    with pytest.raises(DFlashTrtError, match="cannot load"):
        plugin.load_plugin_library(not_a_library)
