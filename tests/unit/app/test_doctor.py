"""`ragline doctor`: each check finds what is wrong on a machine made to lack it, and says
what to do; the command fails on a FAIL and passes on warnings."""

from __future__ import annotations

import socket

import pytest

from ragline_app import cli, doctor
from ragline_app.doctor import FAIL, OK, WARN, Options
from support.cpus import HASWELL, SANDY_BRIDGE


def test_a_port_of_the_layout_in_use_fails_and_names_it_with_the_free_ports_way_out():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        # The layout starting at the taken port: the orchestrator would listen there.
        finding = doctor.ports(Options(base_port=taken))
    assert finding.state == FAIL
    assert str(taken) in finding.detail
    assert "BASE_PORT=0" in finding.advice


def test_free_ports_need_no_check():
    assert doctor.ports(Options(base_port=0)).state == OK
    assert doctor.ports(Options(purpose="test")).state == OK


def test_an_engine_that_does_not_run_fails_with_the_reason_and_a_way_out(tmp_path, monkeypatch):
    binary = tmp_path / "llama-server"
    binary.write_text(
        "#!/bin/sh\necho 'llama-server: error while loading shared libraries: libgomp.so.1'"
        " >&2\nexit 127\n"
    )
    binary.chmod(0o755)
    monkeypatch.setenv("RAGLINE_GENERATION_LLAMA_SERVER", str(binary))
    finding = doctor.engine(Options())
    assert finding.state == FAIL
    assert "libgomp.so.1" in finding.detail
    assert "libgomp1" in finding.advice and "make llama-server-from-source" in finding.advice


def test_no_engine_yet_is_a_warning_that_make_up_installs_it(tmp_path, monkeypatch):
    from ragline_services.generation import llama_engine

    monkeypatch.setenv("RAGLINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(llama_engine, "prebuilt_llama_server", lambda *_: None)
    finding = doctor.engine(Options())
    assert finding.state == WARN
    assert "make llama-server" in finding.advice


def test_build_tools_are_needed_only_where_the_prebuilt_engine_cannot_run(monkeypatch):
    from ragline_services.generation import llama_engine

    monkeypatch.setattr(doctor.shutil, "which", lambda tool: None)
    monkeypatch.setattr(llama_engine, "prebuilt_llama_server", lambda *_: None)
    monkeypatch.setattr(llama_engine, "prebuilt_installable", lambda: True)
    monkeypatch.setattr(llama_engine, "machine_cpu_flags", lambda: HASWELL)
    assert doctor.build_tools(Options()).state == OK
    # an x86-64 without AVX2 has no prebuilt engine
    monkeypatch.setattr(llama_engine, "machine_cpu_flags", lambda: SANDY_BRIDGE)
    assert doctor.build_tools(Options()).state == FAIL
    monkeypatch.setattr(llama_engine, "machine_cpu_flags", lambda: HASWELL)
    monkeypatch.setattr(llama_engine, "prebuilt_installable", lambda: False)
    finding = doctor.build_tools(Options())
    assert finding.state == FAIL
    assert "cmake" in finding.detail and "apt-get install cmake g++" in finding.advice


def test_models_not_prepared_are_a_warning_naming_them(tmp_path, monkeypatch):
    monkeypatch.setenv("RAGLINE_MODEL_DIR", str(tmp_path))
    finding = doctor.models(Options())
    assert finding.state == WARN
    assert "me5-small-int8" in finding.detail
    assert "ragline models prepare" in finding.advice


def test_too_little_disk_fails_naming_the_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("RAGLINE_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setattr(doctor, "DATA_BYTES", 1 << 60)
    finding = doctor.disk(Options())
    assert finding.state == FAIL
    assert str(tmp_path) in finding.detail and "RAGLINE_DATA_DIR" in finding.advice


def test_no_node_fails_only_for_the_tests(monkeypatch):
    monkeypatch.setattr(doctor.shutil, "which", lambda tool: None)
    assert doctor.node(Options()).state == FAIL
    checks = [c.__name__ for c in doctor.UP_CHECKS]
    assert "node" not in checks and "redis" not in checks


def test_a_check_that_breaks_is_a_failure_not_a_crash(monkeypatch):
    def broken(_):
        raise RuntimeError("boom")

    monkeypatch.setattr(doctor, "UP_CHECKS", (broken,))
    (finding,) = doctor.run_checks(Options())
    assert finding.state == FAIL and "boom" in finding.detail


@pytest.mark.parametrize(("state", "code"), [(OK, 0), (WARN, 0), (FAIL, 1)])
def test_the_command_fails_only_on_a_failure_and_prints_the_advice(
    state, code, monkeypatch, capsys
):
    finding = doctor.Finding("thing", state, "what was found", "what to do")
    monkeypatch.setattr(doctor, "UP_CHECKS", (lambda _: finding,))
    assert cli.main(["doctor"]) == code
    printed = capsys.readouterr()
    assert "what was found" in printed.out and "-> what to do" in printed.out
    assert ("fix thing first" in printed.err) == (state == FAIL)
