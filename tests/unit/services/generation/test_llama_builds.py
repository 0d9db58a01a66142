"""Which llama-server build a machine gets: its instruction sets name the build, and the
service runs the machine's own build where it exists, else the portable one."""

from __future__ import annotations

from ragline_services.generation import llama_engine
from ragline_services.generation.llama_engine import (
    LLAMA_BUILD_TAG,
    PORTABLE,
    cpu_build,
    default_llama_cache,
    find_llama_server,
)

AVX512 = {"avx2", "fma", "f16c", "avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"}


def test_an_avx2_machine_gets_the_portable_build():
    assert cpu_build({"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"}) == PORTABLE
    assert cpu_build(set()) == PORTABLE  # flags unreadable: nothing assumed


def test_each_instruction_set_present_is_named_and_switched_on():
    build = cpu_build(AVX512 | {"avx512_vnni", "avx512_bf16"})
    assert build.name == "avx512-vnni-bf16"
    assert build.cmake_options == (
        "-DGGML_AVX512=ON",
        "-DGGML_AVX512_VNNI=ON",
        "-DGGML_AVX512_BF16=ON",
    )


def test_avx512_extensions_need_avx512_itself():
    # VNNI flags without the AVX-512 foundation (some hypervisors mask part of it)
    build = cpu_build({"avx2", "avx512f", "avx512_vnni", "avx_vnni"})
    assert build.name == "avxvnni"
    assert "-DGGML_AVX512_VNNI=ON" not in build.cmake_options


def test_amx_is_never_switched_on():
    build = cpu_build(AVX512 | {"avx512_vnni", "amx_tile", "amx_int8", "amx_bf16"})
    assert not any("AMX" in option for option in build.cmake_options)


def test_the_cache_folder_names_the_build(tmp_path):
    assert default_llama_cache(tmp_path) == tmp_path / "llama.cpp" / LLAMA_BUILD_TAG
    build = cpu_build(AVX512)
    assert default_llama_cache(tmp_path, build).name == f"{LLAMA_BUILD_TAG}-avx512"


def test_the_machines_own_build_is_preferred_then_the_portable_one(tmp_path, monkeypatch):
    monkeypatch.setattr(llama_engine, "machine_cpu_flags", lambda: AVX512)
    own = default_llama_cache(tmp_path, cpu_build(AVX512)) / "llama-server"
    portable = default_llama_cache(tmp_path) / "llama-server"
    assert find_llama_server(tmp_path) == own  # neither built: where to build it
    portable.parent.mkdir(parents=True)
    portable.touch()
    assert find_llama_server(tmp_path) == portable  # an image's build, or an older one
    own.parent.mkdir(parents=True)
    own.touch()
    assert find_llama_server(tmp_path) == own
