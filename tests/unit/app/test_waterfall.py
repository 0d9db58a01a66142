from __future__ import annotations

from rich.console import Console

from ragline.timing import duration
from ragline.v1 import orchestrator_pb2
from ragline_app.waterfall import render_png, render_text, rows


def report() -> orchestrator_pb2.TimingReport:
    timing = orchestrator_pb2.TimingReport(
        end_to_end=duration(1.0),
        critical_path=["embed", "generate"],
        critical_path_lower_bound=duration(0.9),
        overhead_ratio=1.11,
    )
    embed = timing.nodes.add(node_id="embed", kind=orchestrator_pb2.NODE_KIND_EMBED, state=1)
    for name, at in (
        ("reserve_start", 0.0),
        ("call_start", 0.01),
        ("call_end", 0.05),
        ("settled", 0.06),
    ):
        getattr(embed, name).CopyFrom(duration(at))
    generate = timing.nodes.add(
        node_id="generate", kind=orchestrator_pb2.NODE_KIND_GENERATE, state=1
    )
    for name, at in (
        ("reserve_start", 0.05),
        ("call_start", 0.06),
        ("first_byte", 0.7),
        ("call_end", 0.95),
        ("settled", 0.97),
    ):
        getattr(generate, name).CopyFrom(duration(at))
    generate.server.total.CopyFrom(duration(0.88))
    generate.server.queue_wait.CopyFrom(duration(0.2))
    timing.admission_wait.CopyFrom(duration(0.3))
    timing.nodes.add(
        node_id="rerank",
        kind=orchestrator_pb2.NODE_KIND_RERANK,
        state=2,
        error="UNAVAILABLE: rerank down",
    )
    return timing


def test_rows_split_each_node_into_its_phases():
    by_id = {row.node_id: row for row in rows(report())}
    assert [p[0] for p in by_id["generate"].phases] == [
        "reserve",
        "queued",
        "call",
        "stream",
        "settle",
    ]
    # The engine's queue: the first 0.2 s of the call, before its work (and first byte).
    queued = next(p for p in by_id["generate"].phases if p[0] == "queued")
    assert queued[1:] == (0.06, 0.26) and abs(by_id["generate"].queued_s - 0.2) < 1e-9
    assert [p[0] for p in by_id["embed"].phases] == ["reserve", "call", "settle"]
    # The run's own wait for admission, a row before every step.
    assert by_id["admission"].phases == [("admission", 0.0, 0.3)]
    assert next(iter(rows(report()))).node_id == "admission"
    assert by_id["generate"].critical and not by_id["rerank"].critical
    assert by_id["rerank"].phases == [] and by_id["rerank"].state == "failed"
    assert abs(by_id["generate"].server_s - 0.88) < 1e-9


def test_the_waterfall_draws_in_the_terminal_and_as_a_picture(tmp_path):
    console = Console(record=True, width=140)
    console.print(render_text(report()))
    text = console.export_text()
    assert "generate (generate)" in text and "embed -> generate" in text
    assert "UNAVAILABLE" in text
    assert "admission (queue)" in text and "200.0" in text  # the waits, in the table
    render_png(report(), tmp_path / "w.png")
    assert (tmp_path / "w.png").read_bytes()[:4] == b"\x89PNG"


def test_a_node_of_several_calls_says_so_and_draws_no_summed_queue():
    """A synthesis's parts ran side by side: their queue waits summed are no stretch of the
    node's own time, so none is drawn; the server figure says how many calls it sums."""
    several = report()
    generate = next(n for n in several.nodes if n.node_id == "generate")
    generate.calls = 3
    by_id = {row.node_id: row for row in rows(several)}
    assert [p[0] for p in by_id["generate"].phases] == ["reserve", "call", "stream", "settle"]
    assert abs(by_id["generate"].queued_s - 0.2) < 1e-9  # still a number in the table
    console = Console(record=True, width=160)
    console.print(render_text(several))
    assert "880.0 (3 calls)" in console.export_text()
