"""Writes the Grafana dashboard the Helm chart ships (deploy/k8s/helm/ragline/dashboards/
ragline.json): an overview row, then one row per service, every panel a query over the
metrics docs/operations.md documents.

    .venv/bin/python tools/make_dashboard.py [--check]

`--check` fails when the committed file differs from what this writes (tests/deploy runs
it). Queries select `namespace=~"$namespace"`; the data source is a dashboard variable, so
the JSON imports into any Grafana with a Prometheus data source.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "deploy/k8s/helm/ragline/dashboards/ragline.json"
# Every query's own selector: `{S}` (or `{S,more="..."}`) in the expressions below.
SELECTOR = 'namespace=~"$namespace"'
RATE = "$__rate_interval"
GRPC = {
    "orchestrator": "ragline.v1.OrchestratorService",
    "embedding": "ragline.v1.EmbeddingService",
    "retrieval": "ragline.v1.RetrievalService",
    "rerank": "ragline.v1.RerankService",
    "generation": "ragline.v1.GenerationService",
    "budget": "ragline.v1.BudgetService",
}
CALLER_CODES = "OK|INVALID_ARGUMENT|NOT_FOUND|PERMISSION_DENIED|UNAUTHENTICATED|CANCELLED"


def q(expr: str) -> str:
    return expr.replace("{S", "{" + SELECTOR).replace("[R]", f"[{RATE}]")


def p95(metric: str, by: str, where: str = "") -> str:
    extra = f",{where}" if where else ""
    grouping = f"le, {by}" if by else "le"
    return q(
        f"histogram_quantile(0.95, sum by ({grouping}) (rate({metric}_bucket{{S{extra}}}[R])))"
    )


def ratio(numerator: str, denominator: str, by: str = "") -> str:
    grouping = f"sum by ({by}) " if by else "sum "
    return q(f"{grouping}(rate({numerator}[R])) / {grouping}(rate({denominator}[R]))")


def grpc_panels(service: str) -> list[tuple[str, str, list[tuple[str, str]]]]:
    """Requests/s, errors and p95 of one service's methods."""
    where = f'grpc_service="{GRPC[service]}"'
    return [
        (
            "Requests/s by method and code",
            "reqps",
            [
                (
                    q(
                        "sum by (grpc_method, grpc_code) "
                        f"(rate(grpc_server_handled_total{{S,{where}}}[R]))"
                    ),
                    "{{grpc_method}} {{grpc_code}}",
                )
            ],
        ),
        (
            "p95 latency by method",
            "s",
            [(p95("grpc_server_handling_seconds", "grpc_method", where), "{{grpc_method}}")],
        ),
        (
            "Started/s and in flight",
            "short",
            [
                (
                    q(f"sum by (grpc_method) (rate(grpc_server_started_total{{S,{where}}}[R]))"),
                    "started/s {{grpc_method}}",
                ),
                (
                    q(f"sum by (grpc_method) (ragline_grpc_server_in_flight{{S,{where}}})"),
                    "in flight {{grpc_method}}",
                ),
            ],
        ),
    ]


def batcher_panels(batcher: str) -> list:
    where = f'batcher="{batcher}"'
    return [
        (
            f"{batcher}: texts per run",
            "short",
            [
                (
                    q(
                        f"sum by (lane) (rate(ragline_batch_texts_sum{{S,{where}}}[R])) / "
                        f"sum by (lane) (rate(ragline_batch_texts_count{{S,{where}}}[R]))"
                    ),
                    "{{lane}}",
                )
            ],
        ),
        (
            f"{batcher}: p95 queue wait and run",
            "s",
            [
                (p95("ragline_batch_queue_wait_seconds", "lane", where), "wait {{lane}}"),
                (p95("ragline_batch_run_seconds", "lane", where), "run {{lane}}"),
            ],
        ),
        (
            f"{batcher}: queue and runs",
            "short",
            [
                (q(f"sum(ragline_batch_queued_texts{{S,{where}}})"), "queued texts"),
                (q(f"sum(ragline_batch_runs_in_flight{{S,{where}}})"), "runs"),
                (q(f"sum(ragline_batch_runners{{S,{where}}})"), "runners"),
                (
                    q(f"sum by (scope) (rate(ragline_batch_refusals_total{{S,{where}}}[R]))"),
                    "refused/s {{scope}}",
                ),
                (
                    q(f"sum by (reason) (rate(ragline_batch_dropped_total{{S,{where}}}[R]))"),
                    "dropped/s {{reason}}",
                ),
            ],
        ),
    ]


ROWS: list[tuple[str, list]] = [
    (
        "Overview",
        [
            (
                "Requests/s by service",
                "reqps",
                [
                    (
                        q("sum by (grpc_service) (rate(grpc_server_handled_total{S}[R]))"),
                        "{{grpc_service}}",
                    )
                ],
            ),
            (
                "Error ratio by service (callers' mistakes aside)",
                "percentunit",
                [
                    (
                        q(
                            "sum by (grpc_service) (rate(grpc_server_handled_total"
                            f'{{S,grpc_code!~"{CALLER_CODES}"}}[R])) / '
                            "sum by (grpc_service) (rate(grpc_server_handled_total{S}[R]))"
                        ),
                        "{{grpc_service}}",
                    )
                ],
            ),
            (
                "p95 latency by service",
                "s",
                [(p95("grpc_server_handling_seconds", "grpc_service"), "{{grpc_service}}")],
            ),
            (
                "Pods by version (a rollout in progress shows two)",
                "short",
                [(q("count by (version) (ragline_build_info{S})"), "{{version}}")],
            ),
        ],
    ),
    (
        "Orchestrator",
        [
            (
                "Answers/s by state and reason",
                "reqps",
                [
                    (
                        q(
                            "sum by (state, reason) "
                            "(rate(ragline_orchestrator_answers_total{S}[R]))"
                        ),
                        "{{state}} {{reason}}",
                    )
                ],
            ),
            (
                "p95 of each plan node",
                "s",
                [(p95("ragline_orchestrator_node_seconds", "kind"), "{{kind}}")],
            ),
            (
                "Cache hit ratio by layer (under 30%: caching does not pay)",
                "percentunit",
                [
                    (
                        ratio(
                            'ragline_orchestrator_cache_lookups_total{S,result="hit"}',
                            "ragline_orchestrator_cache_lookups_total{S}",
                            "cache",
                        ),
                        "{{cache}}",
                    )
                ],
            ),
            (
                "Admission",
                "short",
                [
                    (q("sum(ragline_orchestrator_runs_in_flight{S})"), "in flight"),
                    (q("sum(ragline_orchestrator_runs_waiting{S})"), "waiting"),
                    (q("sum(ragline_orchestrator_run_places{S})"), "places"),
                    (
                        q("sum by (reason) (rate(ragline_orchestrator_refusals_total{S}[R]))"),
                        "refused/s {{reason}}",
                    ),
                    (
                        q("sum(rate(ragline_orchestrator_generations_raised_total{S}[R]))"),
                        "generations raised to light/s",
                    ),
                ],
            ),
            (
                "p95 wait for a run place",
                "s",
                [(p95("ragline_orchestrator_admission_wait_seconds", ""), "admission wait")],
            ),
            (
                "Escalations/s: made by signal, not made by why",
                "reqps",
                [
                    (
                        q("sum by (signal) (rate(ragline_orchestrator_escalations_total{S}[R]))"),
                        "{{signal}}",
                    ),
                    (
                        q(
                            "sum by (why) "
                            "(rate(ragline_orchestrator_escalations_not_made_total{S}[R]))"
                        ),
                        "not made: {{why}}",
                    ),
                ],
            ),
            *grpc_panels("orchestrator"),
        ],
    ),
    ("Embedding", [*batcher_panels("embedding"), *grpc_panels("embedding")]),
    (
        "Retrieval",
        [
            (
                "p95 search by mode",
                "s",
                [(p95("ragline_retrieval_search_seconds", "mode"), "{{mode}}")],
            ),
            (
                "Fallbacks to BM25/s by reason",
                "reqps",
                [
                    (
                        q("sum by (reason) (rate(ragline_retrieval_search_fallbacks_total{S}[R]))"),
                        "{{reason}}",
                    )
                ],
            ),
            (
                "Index",
                "short",
                [
                    (q("sum(ragline_retrieval_documents{S})"), "documents"),
                    (q("sum(ragline_retrieval_delta_documents{S})"), "delta"),
                    (q("sum(ragline_retrieval_apply_lag_writes{S})"), "apply lag (writes)"),
                    (
                        q("sum(ragline_retrieval_reembed_remaining_documents{S})"),
                        "re-embed left",
                    ),
                ],
            ),
            (
                "Write log",
                "bytes",
                [
                    (q("sum(ragline_retrieval_wal_bytes{S})"), "write log"),
                    (
                        q("sum(increase(ragline_retrieval_wal_compactions_total{S}[1h]))"),
                        "compactions in the last hour",
                    ),
                ],
            ),
            (
                "Documents written/s",
                "reqps",
                [
                    (
                        q(
                            "sum by (operation) "
                            "(rate(ragline_retrieval_documents_written_total{S}[R]))"
                        ),
                        "{{operation}}",
                    )
                ],
            ),
            (
                "Delete notices to rerank and generation",
                "short",
                [
                    (
                        q(
                            "sum by (result) "
                            "(increase(ragline_retrieval_forget_notices_total{S}[1h]))"
                        ),
                        "{{result}} in the last hour",
                    ),
                    (
                        q("sum(ragline_retrieval_forget_notice_ids_waiting{S})"),
                        "ids waiting",
                    ),
                ],
            ),
            (
                "HNSW builds (seconds each)",
                "s",
                [
                    (
                        q(
                            "sum(rate(ragline_retrieval_build_seconds_sum{S}[1h])) / "
                            "sum(rate(ragline_retrieval_build_seconds_count{S}[1h]))"
                        ),
                        "mean build",
                    ),
                    (q("max(ragline_retrieval_rebuilding{S})"), "building"),
                    (q("min(ragline_retrieval_vector_index_ready{S})"), "vector index ready"),
                ],
            ),
            *grpc_panels("retrieval"),
        ],
    ),
    (
        "Rerank",
        [
            *batcher_panels("rerank-tokens"),
            (
                "Token cache hit ratio",
                "percentunit",
                [
                    (
                        ratio(
                            'ragline_rerank_token_cache_lookups_total{S,result="hit"}',
                            "ragline_rerank_token_cache_lookups_total{S}",
                        ),
                        "hit ratio",
                    )
                ],
            ),
            (
                "Token cache",
                "bytes",
                [(q("sum(ragline_rerank_token_cache_bytes{S})"), "bytes")],
            ),
            *grpc_panels("rerank"),
        ],
    ),
    (
        "Generation",
        [
            (
                "Slots busy / slots, requests waiting",
                "short",
                [
                    (q("sum by (tier) (ragline_generation_slots_busy{S})"), "busy {{tier}}"),
                    (q("sum by (tier) (ragline_generation_slots{S})"), "slots {{tier}}"),
                    (
                        q("sum by (tier) (ragline_generation_requests_waiting{S})"),
                        "waiting {{tier}}",
                    ),
                ],
            ),
            (
                "p95 time to first token and queue wait",
                "s",
                [
                    (
                        p95("ragline_generation_time_to_first_token_seconds", "tier"),
                        "TTFT {{tier}}",
                    ),
                    (p95("ragline_generation_queue_wait_seconds", "tier"), "queue {{tier}}"),
                ],
            ),
            (
                "Time per output token (median, p95)",
                "s",
                [
                    (
                        q(
                            "histogram_quantile(0.5, sum by (le, tier) (rate("
                            "ragline_generation_time_per_output_token_seconds_bucket{S}[R])))"
                        ),
                        "median {{tier}}",
                    ),
                    (
                        p95("ragline_generation_time_per_output_token_seconds", "tier"),
                        "p95 {{tier}}",
                    ),
                ],
            ),
            (
                "Tokens/s in and out",
                "short",
                [
                    (
                        q("sum by (tier, kind) (rate(ragline_generation_tokens_total{S}[R]))"),
                        "{{tier}} {{kind}}",
                    )
                ],
            ),
            (
                "Finishes, refusals and pauses/s",
                "reqps",
                [
                    (
                        q("sum by (tier, finish) (rate(ragline_generation_requests_total{S}[R]))"),
                        "{{tier}} {{finish}}",
                    ),
                    (
                        q("sum by (tier, reason) (rate(ragline_generation_refusals_total{S}[R]))"),
                        "refused {{tier}} {{reason}}",
                    ),
                    (
                        q("sum by (tier) (rate(ragline_generation_pauses_total{S}[R]))"),
                        "paused for a light tenant {{tier}}",
                    ),
                    (
                        q("sum by (tier) (rate(ragline_generation_kept_for_deadline_total{S}[R]))"),
                        "kept running for its deadline {{tier}}",
                    ),
                    (
                        q("sum by (tier) (rate(ragline_generation_decoding_beside_total{S}[R]))"),
                        "decoding beside a light tenant {{tier}}",
                    ),
                    (
                        q("sum by (tier) (rate(ragline_generation_yielding_prompts_total{S}[R]))"),
                        "prompt read in yielding steps {{tier}}",
                    ),
                ],
            ),
            (
                "Prefix store hit ratio, speculation acceptance",
                "percentunit",
                [
                    (
                        ratio(
                            'ragline_generation_prefix_store_events_total{S,event="hits"}',
                            'ragline_generation_prefix_store_events_total{S,event="lookups"}',
                            "tier",
                        ),
                        "prefix hits {{tier}}",
                    ),
                    (
                        q(
                            "sum by (tier) "
                            "(rate(ragline_generation_prefix_store_save_seconds_total{S}[R]))"
                        ),
                        "slot time saving prefixes {{tier}}",
                    ),
                    (
                        ratio(
                            'ragline_generation_speculation_tokens_total{S,result="accepted"}',
                            "ragline_generation_speculation_tokens_total{S}",
                            "tier",
                        ),
                        "accepted {{tier}}",
                    ),
                ],
            ),
            (
                "Engines up, prefix store bytes",
                "short",
                [
                    (q("min by (tier) (ragline_generation_engine_up{S})"), "up {{tier}}"),
                    (
                        q("sum by (tier) (ragline_generation_prefix_store_bytes{S})"),
                        "store bytes {{tier}}",
                    ),
                    (
                        q(
                            "sum by (tier) "
                            "(rate(ragline_generation_prefix_store_saved_bytes_total{S}[R]))"
                        ),
                        "saved bytes/s {{tier}}",
                    ),
                ],
            ),
            *grpc_panels("generation"),
        ],
    ),
    (
        "Budget",
        [
            (
                "Ledger operations/s by result",
                "reqps",
                [
                    (
                        q(
                            "sum by (operation, result) "
                            "(rate(ragline_budget_operations_total{S}[R]))"
                        ),
                        "{{operation}} {{result}}",
                    )
                ],
            ),
            (
                "etcd p95 by operation",
                "s",
                [(p95("ragline_budget_etcd_seconds", "operation"), "{{operation}}")],
            ),
            (
                "Conflicts/s and etcd reachable",
                "short",
                [
                    (q("sum(rate(ragline_budget_conflicts_total{S}[R]))"), "conflicts/s"),
                    (q("min(ragline_budget_etcd_reachable{S})"), "etcd reachable"),
                ],
            ),
            *grpc_panels("budget"),
        ],
    ),
    (
        "Gateway (HTTP)",
        [
            (
                "Requests/s by route and status",
                "reqps",
                [
                    (
                        q("sum by (route, status) (rate(ragline_gateway_requests_total{S}[R]))"),
                        "{{route}} {{status}}",
                    )
                ],
            ),
            (
                "p95 by route (a streamed answer: to its last byte)",
                "s",
                [(p95("ragline_gateway_request_seconds", "route"), "{{route}}")],
            ),
        ],
    ),
]


def dashboard() -> dict:
    panels: list[dict] = []
    next_id = 1
    y = 0
    for title, row in ROWS:
        panels.append(
            {
                "type": "row",
                "title": title,
                "id": next_id,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        next_id += 1
        y += 1
        for index, (panel_title, unit, targets) in enumerate(row):
            panels.append(
                {
                    "type": "timeseries",
                    "title": panel_title,
                    "id": next_id,
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    "gridPos": {"h": 8, "w": 8, "x": (index % 3) * 8, "y": y + (index // 3) * 8},
                    "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                    "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
                    "targets": [
                        {
                            "refId": chr(ord("A") + n),
                            "expr": expr,
                            "legendFormat": legend,
                            "datasource": {"type": "prometheus", "uid": "${datasource}"},
                        }
                        for n, (expr, legend) in enumerate(targets)
                    ],
                }
            )
            next_id += 1
        y += 8 * ((len(row) + 2) // 3)
    return {
        "title": "ragline",
        "uid": "ragline-overview",
        "tags": ["ragline"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "editable": True,
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Data source",
                    "type": "datasource",
                    "query": "prometheus",
                },
                {
                    "name": "namespace",
                    "label": "Namespace",
                    "type": "query",
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    "query": "label_values(grpc_server_started_total, namespace)",
                    "includeAll": True,
                    "multi": True,
                    "refresh": 2,
                },
            ]
        },
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=1, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the file is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is stale: run tools/make_dashboard.py", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT} ({len(ROWS)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
