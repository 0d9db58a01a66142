"""Where the time of one Ask went, drawn from its TimingReport: in the terminal (rich) or
as a picture (matplotlib), the critical path highlighted. Every wait is drawn as one: the
run's wait for admission (a row of its own) and, inside a call, the time the request sat in
the service's queue (the server's own report) before its work began."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ragline.timing import seconds_of

# Phases of a node, in the order they happen, with their colours.
PHASES = (
    ("admission", "queued for admission", "#e78ac3"),
    ("queued", "queued at the service", "#fc8d62"),
    ("reserve", "budget reservation", "#8da0cb"),
    ("call", "call, to the first byte", "#66c2a5"),
    ("stream", "streaming", "#a6d854"),
    ("settle", "settlement (off the path)", "#d9d9d9"),
)


def _state_label(number: int) -> str:
    """A node's state as the report names it (NODE_STATE_SKIPPED: "skipped"), "ok" for a
    step that succeeded, "?" for a state this client does not know."""
    from ragline.v1 import orchestrator_pb2

    if number == orchestrator_pb2.NODE_STATE_SUCCEEDED:
        return "ok"
    if number == orchestrator_pb2.NODE_STATE_UNSPECIFIED:
        return "?"
    try:
        return orchestrator_pb2.NodeState.Name(number).removeprefix("NODE_STATE_").lower()
    except ValueError:
        return "?"


@dataclass(frozen=True)
class Row:
    node_id: str
    kind: str
    state: str
    critical: bool
    phases: list[tuple[str, float, float]]  # (phase, start_s, end_s)
    server_s: float | None  # the service's own total
    note: str
    queued_s: float = 0.0  # in the service's queue (admission's, for the admission row)
    calls: int = 0  # service calls the node made (their server times summed)


def rows(report) -> list[Row]:
    from ragline.v1 import orchestrator_pb2

    critical = set(report.critical_path)
    out = []
    admitted = seconds_of(report.admission_wait)
    if admitted > 0:
        phases = [("admission", 0.0, admitted)]
        out.append(Row("admission", "queue", "ok", False, phases, None, "", admitted))
    for node in report.nodes:
        marks = {
            name: seconds_of(getattr(node, name)) if node.HasField(name) else None
            for name in ("reserve_start", "call_start", "first_byte", "call_end", "settled")
        }
        phases = []
        if marks["reserve_start"] is not None and marks["call_start"] is not None:
            phases.append(("reserve", marks["reserve_start"], marks["call_start"]))
        queued = seconds_of(node.server.queue_wait) if node.HasField("server") else 0.0
        # Several calls' queue waits summed (side by side, perhaps) are not one stretch of
        # the node's time: drawn for a single call only, shown as a number either way.
        drawn_queue = queued if node.calls <= 1 else 0.0
        if marks["call_start"] is not None and marks["call_end"] is not None:
            split = marks["first_byte"] or marks["call_end"]
            # The service's queue wait drawn first in the call (the network's share of a
            # loopback call is a fraction of a millisecond).
            began = min(marks["call_start"] + drawn_queue, split)
            if began > marks["call_start"]:
                phases.append(("queued", marks["call_start"], began))
            phases.append(("call", began, split))
            if split < marks["call_end"]:
                phases.append(("stream", split, marks["call_end"]))
        if marks["call_end"] is not None and marks["settled"] is not None:
            phases.append(("settle", marks["call_end"], marks["settled"]))
        out.append(
            Row(
                node_id=node.node_id,
                kind=orchestrator_pb2.NodeKind.Name(node.kind).removeprefix("NODE_KIND_").lower(),
                state=_state_label(node.state),
                critical=node.node_id in critical,
                phases=phases,
                server_s=seconds_of(node.server.total) if node.HasField("server") else None,
                note=node.error,
                queued_s=queued,
                calls=node.calls,
            )
        )
    return out


def _calls(row: Row) -> str:
    """How many calls a server figure sums, where it sums several."""
    return f" ({row.calls} calls)" if row.calls > 1 else ""


def render_text(report, width: int = 60):
    """A rich Table: one bar per node on a shared time axis."""
    from rich.table import Table
    from rich.text import Text

    table_rows = rows(report)
    total = max(seconds_of(report.end_to_end), 1e-6)
    scale = width / total
    table = Table(
        title=(
            f"end to end {total * 1000:.0f} ms; critical path "
            f"{' -> '.join(report.critical_path)} = "
            f"{seconds_of(report.critical_path_lower_bound) * 1000:.0f} ms "
            f"(measured / lower bound {report.overhead_ratio:.2f})"
        ),
        title_justify="left",
    )
    for column in ("node", "state", f"0 .. {total * 1000:.0f} ms", "ms", "server ms", "queued ms"):
        table.add_column(column)
    colours = {name: colour for name, _, colour in PHASES}
    for row in table_rows:
        bar = Text(" " * width)
        for phase, start, end in row.phases:
            left, right = int(start * scale), max(int(end * scale), int(start * scale) + 1)
            bar.stylize(f"on {colours[phase]}", min(left, width - 1), min(right, width))
        spent = sum(end - start for phase, start, end in row.phases if phase != "settle")
        name = Text(f"{row.node_id} ({row.kind})", style="bold" if row.critical else "")
        table.add_row(
            name,
            row.state + (f": {row.note[:40]}" if row.note else ""),
            bar,
            f"{spent * 1000:.1f}",
            "" if row.server_s is None else f"{row.server_s * 1000:.1f}" + _calls(row),
            f"{row.queued_s * 1000:.1f}" if row.queued_s else "",
        )
    return table


def render_png(report, path: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table_rows = rows(report)
    colours = {name: colour for name, _, colour in PHASES}
    figure, axes = plt.subplots(figsize=(10, 0.5 * len(table_rows) + 1.5))
    for y, row in enumerate(reversed(table_rows)):
        for phase, start, end in row.phases:
            axes.barh(
                y,
                (end - start) * 1000,
                left=start * 1000,
                color=colours[phase],
                edgecolor="#d62728" if row.critical and phase != "settle" else "none",
                linewidth=2,
            )
    axes.set_yticks(range(len(table_rows)))
    axes.set_yticklabels(
        [f"{r.node_id} ({r.state})" for r in reversed(table_rows)],
        fontweight="normal",
    )
    for label, row in zip(axes.get_yticklabels(), reversed(table_rows), strict=True):
        if row.critical:
            label.set_fontweight("bold")
    axes.set_xlabel("ms since the request arrived")
    axes.set_title(
        title
        or f"end to end {seconds_of(report.end_to_end) * 1000:.0f} ms, critical path "
        f"(red outline) {seconds_of(report.critical_path_lower_bound) * 1000:.0f} ms"
    )
    handles = [plt.Rectangle((0, 0), 1, 1, color=colour) for _, _, colour in PHASES]
    axes.legend(
        handles,
        [label for _, label, _ in PHASES],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.22),
        ncol=3,
        fontsize=8,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
