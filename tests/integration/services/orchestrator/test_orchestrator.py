"""`Ask` with every service as a real process: answers with citations, deadlines, cancel,
admission, budgets shared by concurrent Asks, parallel branches, bad plans."""

from __future__ import annotations

import asyncio
import time
import uuid

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from ragline.v1 import (
    budget_pb2,
    budget_pb2_grpc,
    common_pb2,
    orchestrator_pb2,
    orchestrator_pb2_grpc,
)
from support import field_violations, wait_until
from support.orchestrator import answer_calls, ask, generation_slot_free, ledger, who

pytestmark = pytest.mark.integration

WARSAW = "Which river flows through Warsaw?"
# Greedy decoding makes an answer's length a fact of the question: SmolLM2 answers WARSAW
# in ~13 tokens (~1 s in all here, so a 1.2 s deadline could miss it) and this in ~130
# (~2.7 s): a deadline test with it cuts the answer mid-stream on any machine.
LONG_ANSWER = (
    "Describe Warsaw in detail, in at least ten sentences: its river, its history, its "
    "buildings, its parks, its wildlife and its people."
)
# Its answer's cap: seconds of decoding on any machine, so a cut lands mid-stream; a cap
# of 2,000 let the small model write for a minute uncut, twice per test that timed it.
LONG_ANSWER_TOKENS = 200


def result_of(messages) -> orchestrator_pb2.AskResult:
    assert messages[-1].WhichOneof("event") == "result"
    return messages[-1].result


async def settled(budget_address: str, task_id: str) -> bool:
    try:
        found = await ledger(budget_address, task_id)
    except grpc.aio.AioRpcError as error:
        return error.code() == grpc.StatusCode.NOT_FOUND  # never opened: nothing to settle
    states = {r.state for r in found.reservations}
    return found.in_flight == 0 and states <= {budget_pb2.RESERVATION_STATE_SETTLED}


async def test_a_question_about_the_demo_corpus_is_answered_with_a_correct_citation(rag_stack):
    orchestrator = rag_stack.orchestrator()
    messages = await ask(orchestrator.address, orchestrator_pb2.AskRequest(question=WARSAW))
    result = result_of(messages)
    deltas = "".join(m.delta for m in messages if m.WhichOneof("event") == "delta")
    assert "vistula" in result.answer.lower(), result
    assert deltas.strip() == result.answer  # the answer streamed before the result
    assert result.status.state in (
        common_pb2.ANSWER_STATE_COMPLETE,
        common_pb2.ANSWER_STATE_PARTIAL,
    )
    assert result.citations, result
    assert all(c.title == "Warsaw" and "Vistula" in c.snippet for c in result.citations)
    cited = {c.document_id for c in result.citations}
    assert cited <= {e.document_id for e in result.evidence}  # only what the prompt held
    # The report: every step, the budget, the critical path.
    nodes = {n.node_id: n for n in result.timing.nodes}
    assert set(nodes) >= {"embed", "bm25", "vector", "fuse", "evidence", "generate"}
    assert nodes["generate"].HasField("first_byte") and nodes["generate"].server.HasField("total")
    assert result.timing.critical_path[-1] == "generate"
    assert result.timing.overhead_ratio >= 1.0
    assert result.budget.state == budget_pb2.TASK_STATE_CLOSED
    assert result.budget.used.calls >= 3 and result.budget.reserved.calls == 0
    node_events = [m.node for m in messages if m.WhichOneof("event") == "node"]
    assert {e.node_id for e in node_events} >= set(nodes) - {"rerank"}


async def test_the_rerank_cascade_orders_the_evidence_when_the_service_answers(rag_stack):
    orchestrator = rag_stack.orchestrator()
    result = result_of(
        await ask(orchestrator.address, orchestrator_pb2.AskRequest(question=WARSAW))
    )
    nodes = {n.node_id: n for n in result.timing.nodes}
    assert nodes["rerank"].state == orchestrator_pb2.NODE_STATE_SUCCEEDED, nodes["rerank"]
    assert nodes["evidence"].call_start.ToNanoseconds() >= nodes["rerank"].call_end.ToNanoseconds()
    assert nodes["rerank"].server.HasField("total")
    assert "rerank_unavailable" not in result.degraded
    # The question was encoded for rerank while retrieval ran, not after it.
    prepared = nodes["rerank_query"]
    assert prepared.state == orchestrator_pb2.NODE_STATE_SUCCEEDED and not prepared.error
    assert prepared.call_start.ToNanoseconds() < nodes["vector"].call_end.ToNanoseconds()
    assert prepared.kind == orchestrator_pb2.NODE_KIND_RERANK_QUERY
    assert result.evidence[0].title == "Warsaw", result.evidence


async def test_without_the_embedding_service_the_answer_stands_on_bm25_degraded(rag_stack):
    from ragline.processes import free_ports

    nowhere = f"127.0.0.1:{free_ports(1)[0]}"  # the embedding service is down
    orchestrator = rag_stack.orchestrator(embedding_addr=nowhere)
    request = orchestrator_pb2.AskRequest(
        question=WARSAW, cache=orchestrator_pb2.CACHE_POLICY_BYPASS
    )
    result = result_of(await ask(orchestrator.address, request))
    assert result.status.state == common_pb2.ANSWER_STATE_PARTIAL, result.status
    assert result.status.reason.startswith("degraded")
    assert {"embed_unavailable", "evidence_embedding_unavailable"} <= set(result.degraded)
    assert "vistula" in result.answer.lower() and result.citations
    nodes = {n.node_id: n for n in result.timing.nodes}
    assert nodes["embed"].state == orchestrator_pb2.NODE_STATE_FAILED
    # Vector search still ran: with the query text, which retrieval embeds itself.
    assert nodes["vector"].state == orchestrator_pb2.NODE_STATE_SUCCEEDED
    assert nodes["generate"].state == orchestrator_pb2.NODE_STATE_SUCCEEDED


async def test_embedding_and_bm25_run_side_by_side(rag_stack):
    orchestrator = rag_stack.orchestrator()
    result = result_of(
        await ask(orchestrator.address, orchestrator_pb2.AskRequest(question=WARSAW))
    )
    nodes = {n.node_id: n for n in result.timing.nodes}
    embed, bm25 = nodes["embed"], nodes["bm25"]
    # bm25 started before the embedding ended: it did not wait for it.
    assert bm25.call_start.ToNanoseconds() < embed.call_end.ToNanoseconds()
    assert nodes["vector"].call_start.ToNanoseconds() >= embed.call_end.ToNanoseconds()


async def long_answer_s(orchestrator) -> float:
    """How long the long answer takes when nothing cuts it (it must outlast every check
    below, or they would pass because it ended by itself)."""
    return (await long_answer_timing(orchestrator))[0]


async def long_answer_timing(orchestrator) -> tuple[float, float]:
    """(seconds the long answer takes uncut, seconds into the run of its first token)."""
    request = orchestrator_pb2.AskRequest(
        question=LONG_ANSWER,
        max_tokens=LONG_ANSWER_TOKENS,
        cache=orchestrator_pb2.CACHE_POLICY_BYPASS,
    )
    started = time.monotonic()
    result = result_of(await ask(orchestrator.address, request))
    natural = time.monotonic() - started
    assert result.answer or result.draft_answer, result.status
    generate = next(n for n in result.timing.nodes if n.node_id == "generate")
    return natural, generate.first_byte.ToNanoseconds() / 1e9


async def test_a_deadline_during_generation_ends_the_run_partial_and_frees_the_slot_at_once(
    rag_stack,
):
    orchestrator = rag_stack.orchestrator(small=True)
    # Timed warm, as the cut run will be: the first run's prompt prefill is a cache hit
    # for the next (a cold timing put the deadline after the warm answer's end).
    await long_answer_timing(orchestrator)
    natural, first_token = await long_answer_timing(orchestrator)
    decoding = natural - first_token
    assert decoding > 0.8, f"the long answer decoded for {decoding:.2f} s: too short to cut"
    # Past the evidence, halfway through decoding: whatever this machine's speed.
    deadline_s = first_token + decoding / 2
    task_id = f"deadline-{uuid.uuid4().hex[:8]}"
    request = orchestrator_pb2.AskRequest(
        question=LONG_ANSWER,
        task_id=task_id,
        max_tokens=LONG_ANSWER_TOKENS,
        cache=orchestrator_pb2.CACHE_POLICY_BYPASS,
    )
    started = time.monotonic()
    # The server ends the run itself, in time to send the result: no DEADLINE_EXCEEDED from
    # the client's own timer is accepted here.
    result = result_of(await ask(orchestrator.address, request, deadline_s=deadline_s))
    cut_at = time.monotonic()
    assert cut_at - started < deadline_s
    assert result.status.state == common_pb2.ANSWER_STATE_PARTIAL, result.status
    assert result.status.reason == "deadline"
    # Decoding stopped at the cut: the slot is free long before the answer would have ended.
    assert await wait_until(
        lambda: generation_slot_free(rag_stack.small_generation.address), timeout_s=1.0
    )
    assert time.monotonic() - started < natural
    assert await wait_until(lambda: settled(rag_stack.budget.address, task_id), timeout_s=5.0)


async def test_a_callers_deadline_beyond_the_servers_maximum_is_held_to_it(rag_stack):
    """RAGLINE_ORCHESTRATOR_MAX_DEADLINE_S caps what a caller may ask for: a run with a
    60 s deadline is cut at the server's maximum, half the time its answer takes."""
    # The default model (the tests around use the small one's single slot, warm or cold).
    natural = await long_answer_s(rag_stack.orchestrator())
    orchestrator = rag_stack.orchestrator(max_deadline_s=round(natural / 2, 2))
    request = orchestrator_pb2.AskRequest(
        question=LONG_ANSWER,
        max_tokens=LONG_ANSWER_TOKENS,
        cache=orchestrator_pb2.CACHE_POLICY_BYPASS,
    )
    started = time.monotonic()
    result = result_of(await ask(orchestrator.address, request, deadline_s=60))
    assert time.monotonic() - started < natural
    assert result.status.state == common_pb2.ANSWER_STATE_PARTIAL, result.status
    assert result.status.reason == "deadline"


async def test_a_deadline_before_the_evidence_is_in_is_deadline_exceeded_at_once(rag_stack):
    orchestrator = rag_stack.orchestrator(small=True)
    request = orchestrator_pb2.AskRequest(
        question=LONG_ANSWER,
        max_tokens=LONG_ANSWER_TOKENS,
        cache=orchestrator_pb2.CACHE_POLICY_BYPASS,
    )
    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await ask(orchestrator.address, request, deadline_s=0.02)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 0.5
    assert await wait_until(
        lambda: generation_slot_free(rag_stack.small_generation.address), timeout_s=1.0
    )


async def test_a_cancelled_ask_frees_the_generation_slot_and_settles_its_ledger(rag_stack):
    orchestrator = rag_stack.orchestrator(small=True)
    natural = await long_answer_s(orchestrator)
    task_id = f"cancel-{uuid.uuid4().hex[:8]}"
    request = orchestrator_pb2.AskRequest(
        question=LONG_ANSWER,
        task_id=task_id,
        max_tokens=LONG_ANSWER_TOKENS,
        cache=orchestrator_pb2.CACHE_POLICY_BYPASS,
    )
    async with grpc.aio.insecure_channel(orchestrator.address) as channel:
        call = orchestrator_pb2_grpc.OrchestratorServiceStub(channel).Ask(
            request, timeout=60, metadata=who()
        )
        started = time.monotonic()
        async for message in call:
            if message.WhichOneof("event") == "delta":
                break  # generating: cancel mid-stream
        call.cancel()
        cancelled_at = time.monotonic()
    # The cancel reached the engine: the slot is free well before the answer would have
    # ended by itself (within 60% of the time it had left, and at most a second).
    left = natural - (cancelled_at - started)
    window = min(1.0, 0.6 * left)
    assert window >= 0.3, f"the long answer took {natural:.2f} s uncut: too short to cancel"
    assert await wait_until(
        lambda: generation_slot_free(rag_stack.small_generation.address), timeout_s=window
    ), f"the slot was still busy {window:.2f} s after the cancel"
    assert await wait_until(lambda: settled(rag_stack.budget.address, task_id), timeout_s=5.0)
    found = await ledger(rag_stack.budget.address, task_id)
    generate = [r for r in found.reservations if r.stage == "generate"]
    assert generate and generate[0].actual.input_tokens > 0  # partial use was charged


async def test_a_full_queue_is_refused_at_once_with_a_retry_delay(rag_stack):
    orchestrator = rag_stack.orchestrator(small=True, max_in_flight=1, max_queue=0)
    long = orchestrator_pb2.AskRequest(question=WARSAW, max_tokens=2000)
    async with grpc.aio.insecure_channel(orchestrator.address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
        running = stub.Ask(long, timeout=60, metadata=who())
        await running.read()  # admitted: it holds the only place
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in stub.Ask(long, timeout=60, metadata=who()):
                pass
        # Refused while the first still runs, not after waiting for it.
        assert not running.done()
        running.cancel()
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    status = rpc_status.from_call(caught.value)
    assert any(d.Is(error_details_pb2.RetryInfo.DESCRIPTOR) for d in status.details)


@pytest.mark.parametrize("cap", [1, 3])
async def test_calls_to_one_service_never_exceed_its_cap_however_many_runs(rag_stack, cap):
    """RAGLINE_ORCHESTRATOR_GENERATION_CONCURRENCY bounds the Generate calls one
    orchestrator has open, whatever the runs admitted (each answer held 0.4 s here)."""
    from support.generation_proxy import GenerationProxy

    proxy = GenerationProxy(rag_stack.generation.address, lambda request: "Vistula [1]")
    proxy.hold_s = 0.4
    await proxy.start()
    try:
        orchestrator = await asyncio.to_thread(
            rag_stack.orchestrator,
            generation_addr=proxy.address,
            max_in_flight=6,
            generation_concurrency=cap,
        )
        request = orchestrator_pb2.AskRequest(
            question=WARSAW, cache=orchestrator_pb2.CACHE_POLICY_BYPASS
        )
        outcomes = await asyncio.gather(*(ask(orchestrator.address, request) for _ in range(6)))
    finally:
        await proxy.stop()
    assert all(result_of(o) for o in outcomes) and len(proxy.scripted) >= 6
    assert proxy.most_in_flight == cap


async def test_concurrent_asks_sharing_one_task_never_overspend_it(rag_stack):
    orchestrator = rag_stack.orchestrator(small=True, max_in_flight=8)
    task_id = f"shared-{uuid.uuid4().hex[:8]}"
    limits = common_pb2.BudgetAmounts(input_tokens=4000, output_tokens=100, cost_micros=0, calls=30)
    async with grpc.aio.insecure_channel(rag_stack.budget.address) as channel:
        open_task = budget_pb2.OpenTaskRequest(task_id=task_id, limits=limits)
        open_task.timeout.FromSeconds(120)
        await budget_pb2_grpc.BudgetServiceStub(channel).OpenTask(
            open_task, timeout=10, metadata=who()
        )
    request = orchestrator_pb2.AskRequest(question=WARSAW, task_id=task_id, max_tokens=40)
    outcomes = await asyncio.gather(
        *(ask(orchestrator.address, request) for _ in range(6)), return_exceptions=True
    )
    results = [result_of(o) for o in outcomes if not isinstance(o, BaseException)]
    assert len(results) == 6, outcomes
    exhausted = [r for r in results if r.status.reason == "budget_exhausted"]
    assert exhausted and all(
        r.status.state == common_pb2.ANSWER_STATE_INCOMPLETE for r in exhausted
    )
    assert await wait_until(lambda: settled(rag_stack.budget.address, task_id))
    final = await ledger(rag_stack.budget.address, task_id)
    for amount in ("input_tokens", "output_tokens", "calls"):
        assert getattr(final.used, amount) <= getattr(limits, amount), final
    assert final.state == budget_pb2.TASK_STATE_OPEN  # a caller's task is not closed by Ask


async def test_a_reused_run_id_does_not_replay_reservations_uncharged(rag_stack):
    """Reservation ids are unique to each run, whatever run id the caller sends: a second
    Ask with the same x-ragline-run-id and task id is charged again (its reservations are
    not taken for retries of the first's)."""
    orchestrator = rag_stack.orchestrator(small=True)
    task_id = f"rerun-{uuid.uuid4().hex[:8]}"
    request = orchestrator_pb2.AskRequest(
        question=WARSAW, task_id=task_id, max_tokens=16, cache=orchestrator_pb2.CACHE_POLICY_BYPASS
    )
    # The longest run id a caller may send (128 bytes) still leaves reservation ids valid.
    metadata = (*who(), ("x-ragline-run-id", "r" * 128))
    used = []
    async with grpc.aio.insecure_channel(orchestrator.address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
        for _ in range(2):
            [m async for m in stub.Ask(request, timeout=60, metadata=metadata)]
            assert await wait_until(lambda: settled(rag_stack.budget.address, task_id))
            used.append((await ledger(rag_stack.budget.address, task_id)).used)
    assert used[0].calls > 0 and used[1].calls >= 2 * used[0].calls, used
    assert used[1].input_tokens > used[0].input_tokens


async def test_two_independent_branches_take_the_longer_one_not_the_sum(rag_stack):
    orchestrator = rag_stack.orchestrator()
    plan = orchestrator_pb2.Plan()
    for branch, query in (("a", "Vistula river Warsaw"), ("b", "Warsaw population")):
        plan.nodes.add(
            id=f"r{branch}", kind=orchestrator_pb2.NODE_KIND_RETRIEVE, params={"query": query}
        )
        plan.nodes.add(
            id=f"e{branch}",
            kind=orchestrator_pb2.NODE_KIND_SELECT_EVIDENCE,
            depends_on=[f"r{branch}"],
        )
        plan.nodes.add(
            id=f"g{branch}",
            kind=orchestrator_pb2.NODE_KIND_GENERATE,
            depends_on=[f"e{branch}"],
            params={"max_tokens": "24"},
        )
    plan.nodes.add(id="s", kind=orchestrator_pb2.NODE_KIND_SYNTHESIZE, depends_on=["ga", "gb"])
    request = orchestrator_pb2.AskRequest(question=WARSAW, plan=plan)
    result = result_of(await ask(orchestrator.address, request))
    nodes = {n.node_id: n for n in result.timing.nodes}
    assert all(n.state == orchestrator_pb2.NODE_STATE_SUCCEEDED for n in nodes.values())

    def span(node_id):
        n = nodes[node_id]
        return n.reserve_start.ToNanoseconds() / 1e9, n.call_end.ToNanoseconds() / 1e9

    (a0, a1), (b0, b1) = span("ga"), span("gb")
    assert a0 < b1 and b0 < a1, "the two generations did not overlap"
    end_to_end = result.timing.end_to_end.ToNanoseconds() / 1e9
    assert end_to_end < (a1 - a0) + (b1 - b0) + (span("s")[1] - span("s")[0])
    assert result.timing.overhead_ratio < 1.5


@pytest.mark.parametrize(
    ("nodes", "field"),
    [
        ([("a", "RETRIEVE", ["ghost"]), ("g", "GENERATE", ["a"])], "plan.nodes[0].depends_on[0]"),
        (
            [("a", "RETRIEVE", []), ("a", "RETRIEVE", []), ("g", "GENERATE", ["a"])],
            "plan.nodes[1].id",
        ),
        ([("a", "RETRIEVE", ["g"]), ("g", "GENERATE", ["a"])], "plan.nodes[0].depends_on"),
        ([("a", "RETRIEVE", [])], "plan.nodes"),
        (
            [("a", "RETRIEVE", []), ("g", "GENERATE", ["a"]), ("x", "FUSE", ["", "a"])],
            "plan.nodes[2].depends_on[0]",
        ),
    ],
)
async def test_bad_plans_are_refused_naming_the_field(rag_stack, nodes, field):
    orchestrator = rag_stack.orchestrator()
    plan = orchestrator_pb2.Plan()
    for node_id, kind, depends_on in nodes:
        plan.nodes.add(
            id=node_id,
            kind=orchestrator_pb2.NodeKind.Value(f"NODE_KIND_{kind}"),
            depends_on=depends_on,
        )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await ask(orchestrator.address, orchestrator_pb2.AskRequest(question=WARSAW, plan=plan))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in field_violations(caught.value)


@pytest.mark.parametrize(
    ("kind", "param", "value"),
    [
        ("BM25", "k", "5000"),
        ("VECTOR_SEARCH", "hnsw_ef", "100000"),
        ("VECTOR_SEARCH", "k", "99999999999"),
        ("RERANK", "top_k", "2000"),
        ("GENERATE", "max_tokens", "100000"),
        ("FUSE", "vector_weight", "2.5"),
    ],
)
async def test_a_parameter_beyond_what_its_step_accepts_is_refused_naming_it(
    rag_stack, kind, param, value
):
    orchestrator = rag_stack.orchestrator()
    plan = orchestrator_pb2.Plan()
    plan.nodes.add(
        id="s", kind=orchestrator_pb2.NodeKind.Value(f"NODE_KIND_{kind}"), params={param: value}
    )
    answer = "g" if kind != "GENERATE" else "x"
    if kind == "GENERATE":
        plan.nodes[0].id = "g0"
        plan.nodes.add(id="x", kind=orchestrator_pb2.NODE_KIND_SYNTHESIZE, depends_on=["g0"])
    else:
        plan.nodes.add(id=answer, kind=orchestrator_pb2.NODE_KIND_GENERATE, depends_on=["s"])
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await ask(orchestrator.address, orchestrator_pb2.AskRequest(question=WARSAW, plan=plan))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    assert f"plan.nodes[0].params[{param}]" in field_violations(caught.value)


async def test_a_step_this_version_cannot_run_is_unimplemented(rag_stack):
    orchestrator = rag_stack.orchestrator()
    plan = orchestrator_pb2.Plan()
    plan.nodes.add(id="p", kind=orchestrator_pb2.NODE_KIND_PLAN)
    plan.nodes.add(id="g", kind=orchestrator_pb2.NODE_KIND_GENERATE, depends_on=["p"])
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await ask(orchestrator.address, orchestrator_pb2.AskRequest(question=WARSAW, plan=plan))
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def warsaw_behind_a_proxy(rag_stack, *tenants: str, hold_s: float):
    """The Warsaw passage in each tenant's index, and a started generation proxy whose
    scripted answer (citing it) waits `hold_s` before its first word."""
    from support.generation_proxy import GenerationProxy
    from support.retrieval import Client

    warsaw = "Warsaw is the capital of Poland. It stands on the Vistula River."
    writer = Client(rag_stack.retrieval.address)
    for tenant in tenants:
        await writer.upsert(tenant, [{"id": "w", "title": "Warsaw", "text": warsaw}])
    await writer.close()
    proxy = GenerationProxy(rag_stack.generation.address, lambda request: "Vistula [1]")
    proxy.hold_s = hold_s
    await proxy.start()
    return proxy


async def warsaw_asked_as(address: str, tenant: str):
    """The result of one uncached Ask of the Warsaw question as `tenant`."""
    request = orchestrator_pb2.AskRequest(
        question=WARSAW, cache=orchestrator_pb2.CACHE_POLICY_BYPASS
    )
    async with grpc.aio.insecure_channel(address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
        call = stub.Ask(request, timeout=60, metadata=who(tenant))
        return [m async for m in call][-1].result


async def warsaw_asker(rag_stack, proxy):
    """An orchestrator (4 runs in flight) whose generation service is `proxy`, and a
    function that asks it the Warsaw question as a tenant."""
    orchestrator = await asyncio.to_thread(
        rag_stack.orchestrator, generation_addr=proxy.address, max_in_flight=4
    )
    return lambda tenant: warsaw_asked_as(orchestrator.address, tenant)


async def test_a_tenant_asking_alone_beside_a_flood_has_its_generation_marked_light(rag_stack):
    """The front door, which sees a flood's runs in flight, tells the generation service
    which request is a light tenant's (GenerateRequest.light_tenant): that one goes first."""
    # The flood's answers stay in flight.
    proxy = await warsaw_behind_a_proxy(rag_stack, "flood-t", "quiet-t", hold_s=1.5)
    try:
        ask_as = await warsaw_asker(rag_stack, proxy)

        flood = [asyncio.create_task(ask_as("flood-t")) for _ in range(2)]
        deadline = time.monotonic() + 30
        while proxy.in_flight < 2:  # both flood runs are generating
            assert time.monotonic() < deadline, "the flood's runs never reached generation"
            await asyncio.sleep(0.02)
        quiet = await ask_as("quiet-t")
        await asyncio.gather(*flood)
        alone = await ask_as("quiet-t")  # nobody floods now
    finally:
        await proxy.stop()
    assert quiet.answer and alone.answer
    marked = [(r.light_tenant, r.max_tokens) for r in answer_calls(proxy.scripted)]
    assert len(marked) == 4
    assert [light for light, _ in marked] == [False, False, True, False]


async def test_a_generation_under_way_when_its_tenant_turns_light_goes_again_marked(rag_stack):
    """A quiet tenant's generation sent before a flood began goes unmarked (nobody floods
    yet). Once the front door sees the flood (its second run in flight), that generation,
    still before its first token, is sent again marked light, and the answer is the
    marked one's; the timing report counts the two calls."""
    proxy = await warsaw_behind_a_proxy(rag_stack, "flood-r", "quiet-r", hold_s=3.0)
    try:
        ask_as = await warsaw_asker(rag_stack, proxy)

        quiet = asyncio.create_task(ask_as("quiet-r"))
        deadline = time.monotonic() + 30
        while proxy.in_flight < 1:  # the quiet tenant's generation is under way
            assert time.monotonic() < deadline, "the quiet run never reached generation"
            await asyncio.sleep(0.02)
        flood = [asyncio.create_task(ask_as("flood-r")) for _ in range(2)]
        answered = await quiet
        await asyncio.gather(*flood)
    finally:
        await proxy.stop()
    sent = [
        (t, r.light_tenant)
        for t, r in zip(proxy.scripted_for, proxy.scripted, strict=True)
        if answer_calls([r])
    ]
    assert [light for tenant, light in sent if tenant == "quiet-r"] == [False, True], sent
    assert [light for tenant, light in sent if tenant == "flood-r"] == [False, False], sent
    assert answered.status.state == common_pb2.ANSWER_STATE_COMPLETE, answered.status
    [generate] = [n for n in answered.timing.nodes if n.kind == orchestrator_pb2.NODE_KIND_GENERATE]
    assert generate.attempts == 2


async def test_a_tenant_whose_runs_keep_running_out_of_time_is_refused_at_once(rag_stack):
    """Admission learns from how runs end: once most of a tenant's recent runs were cut at
    their deadline, its next run while another of its runs is under way is refused at once
    (RESOURCE_EXHAUSTED with a retry delay) instead of admitted only to be cut too. Its run
    alone, and another tenant's, are still admitted."""
    # Every answer outlasts its run's deadline.
    proxy = await warsaw_behind_a_proxy(rag_stack, "late-t", "other-t", hold_s=30.0)
    try:
        orchestrator = await asyncio.to_thread(
            rag_stack.orchestrator, generation_addr=proxy.address, max_in_flight=4
        )
        async with grpc.aio.insecure_channel(orchestrator.address) as channel:
            stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)

            async def ask_as(tenant: str, deadline_s: float = 2.0):
                request = orchestrator_pb2.AskRequest(
                    question=WARSAW, cache=orchestrator_pb2.CACHE_POLICY_BYPASS
                )
                call = stub.Ask(request, timeout=deadline_s, metadata=who(tenant))
                return [m async for m in call][-1].result

            cut = await asyncio.gather(*(ask_as("late-t") for _ in range(4)))
            assert all(r.status.reason == "deadline" for r in cut), [r.status for r in cut]
            running = asyncio.create_task(ask_as("late-t", deadline_s=5.0))  # alone: admitted

            async def generating() -> bool:
                return proxy.in_flight >= 1

            assert await wait_until(generating, timeout_s=5.0)
            started = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await ask_as("late-t", deadline_s=10.0)
            refused_in = time.monotonic() - started
            other = await ask_as("other-t")  # another tenant: admitted (and cut, as here)
            await running
    finally:
        await proxy.stop()
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "ran out of time" in caught.value.details() and refused_in < 1.0
    status = rpc_status.from_call(caught.value)
    assert any(d.Is(error_details_pb2.RetryInfo.DESCRIPTOR) for d in status.details)
    assert other.status.reason == "deadline"
