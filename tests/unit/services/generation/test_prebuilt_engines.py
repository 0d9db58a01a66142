"""Which prebuilt llama-server a CPU gets
(services/ragline_services/generation/prebuilt.py): the fastest whose instructions it has,
the AVX2 one on any AVX2 x86-64, none without AVX2; an operator's choice wins; the one found
is the installed one of those."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest

from ragline_services.generation import llama_engine, prebuilt
from ragline_services.generation.prebuilt import (
    AVX2,
    AVX512_AMX,
    PREBUILT_ENGINES,
    UnknownPrebuilt,
    installed_prebuilt,
    prebuilt_choices,
)
from ragline_services.generation.service import GenerationConfig
from support.cpus import HASWELL, SANDY_BRIDGE, SAPPHIRE_RAPIDS, ZEN4, ZEN5


def test_each_cpu_generation_gets_the_engines_it_can_run_fastest_first():
    assert prebuilt_choices(SAPPHIRE_RAPIDS) == (AVX512_AMX, AVX2)
    # AVX-512 with VNNI and BF16 but no AVX-VNNI: the AVX-512 wheel died of SIGILL on one
    assert prebuilt_choices(ZEN4) == (AVX2,)
    # the same with AVX-VNNI and still no AMX: the AVX-512 wheel runs (its AMX kernels only
    # where the kernel grants AMX tiles)
    assert prebuilt_choices(ZEN5) == (AVX512_AMX, AVX2)
    assert prebuilt_choices(HASWELL) == (AVX2,)
    assert prebuilt_choices(SANDY_BRIDGE) == ()  # built from source
    assert prebuilt_choices(set()) == ()  # flags unreadable: nothing assumed


def test_an_operators_choice_wins_over_the_flags_and_a_wrong_name_says_the_right_ones():
    assert prebuilt_choices(SAPPHIRE_RAPIDS, "avx2") == (AVX2,)
    with pytest.raises(UnknownPrebuilt, match="avx512-amx, avx2"):
        prebuilt_choices(HASWELL, "avx3")


def test_the_settings_accept_exactly_the_engines_names():
    field = GenerationConfig.model_fields["prebuilt"].annotation
    assert set(typing.get_args(field)) == {""} | {engine.name for engine in PREBUILT_ENGINES}


def test_engines_are_pinned_and_live_in_folders_of_their_own(tmp_path):
    assert len({engine.folder(tmp_path) for engine in PREBUILT_ENGINES}) == len(PREBUILT_ENGINES)
    for engine in PREBUILT_ENGINES:
        assert engine.requirement.endswith(f"--hash=sha256:{engine.wheel_sha256}")
        assert len(engine.wheel_sha256) == 64
        assert engine.binary(tmp_path).is_relative_to(tmp_path / "llama-prebuilt")


def test_the_engine_found_is_the_fastest_installed_one_this_cpu_runs(tmp_path, monkeypatch):
    def put(engine):
        engine.binary(tmp_path).parent.mkdir(parents=True)
        engine.binary(tmp_path).touch()

    assert installed_prebuilt(tmp_path, SAPPHIRE_RAPIDS) is None
    put(AVX512_AMX)
    assert installed_prebuilt(tmp_path, HASWELL) is None  # installed, not runnable here
    assert installed_prebuilt(tmp_path, SAPPHIRE_RAPIDS) == (
        AVX512_AMX, AVX512_AMX.binary(tmp_path)
    )  # fmt: skip
    put(AVX2)
    assert installed_prebuilt(tmp_path, HASWELL) == (AVX2, AVX2.binary(tmp_path))
    assert installed_prebuilt(tmp_path, SAPPHIRE_RAPIDS, "avx2") == (AVX2, AVX2.binary(tmp_path))
    monkeypatch.setattr(llama_engine, "machine_cpu_flags", lambda: HASWELL)
    assert llama_engine.prebuilt_llama_server(tmp_path) == AVX2.binary(tmp_path)
    found = llama_engine.find_llama_server(tmp_path)
    assert found == llama_engine.LlamaServerBinary(AVX2.binary(tmp_path), "prebuilt")


def test_a_failed_install_leaves_nothing_the_service_would_find(tmp_path, monkeypatch):
    class Failed:
        returncode = 1

    monkeypatch.setattr(prebuilt.subprocess, "run", lambda *a, **k: Failed())
    assert "pip could not install" in (prebuilt.install(AVX2, tmp_path) or "")
    assert installed_prebuilt(tmp_path, HASWELL) is None
    assert list((tmp_path / "llama-prebuilt").iterdir()) == []  # no staging folder left


def test_a_wheels_library_copies_become_links_to_the_versioned_file(tmp_path):
    from ragline_services.generation.prebuilt import link_library_copies

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("libggml.so", "libggml.so.0", "libggml.so.0.17.0"):
        (bin_dir / name).write_bytes(b"ELF the same library")
    (bin_dir / "libother.so").write_bytes(b"another library")
    (bin_dir / "libother.so.1").write_bytes(b"not the same bytes")
    (bin_dir / "libother.so.1.2.3").write_bytes(b"not the same bytes either")
    link_library_copies(tmp_path)
    assert (bin_dir / "libggml.so").readlink() == Path("libggml.so.0.17.0")
    assert (bin_dir / "libggml.so.0").readlink() == Path("libggml.so.0.17.0")
    assert (bin_dir / "libggml.so").read_bytes() == b"ELF the same library"
    assert not (bin_dir / "libother.so").is_symlink()  # different bytes stay files
    assert not (bin_dir / "libother.so.1").is_symlink()
