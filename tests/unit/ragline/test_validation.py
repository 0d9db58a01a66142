from __future__ import annotations

import pytest

from ragline.errors import InvalidArgument
from ragline.v1 import (
    budget_pb2,
    common_pb2,
    embedding_pb2,
    generation_pb2,
    orchestrator_pb2,
    retrieval_pb2,
)
from ragline.validation import check_size, validate, violations


def found(message) -> dict[str, str]:
    return {v.field: v.description for v in violations(message)}


def test_valid_requests_pass():
    validate(embedding_pb2.EmbedRequest(texts=["a", "b"], dim=128))
    validate(retrieval_pb2.SearchRequest(query="q", k=10, mode=retrieval_pb2.SEARCH_MODE_BM25))
    validate(generation_pb2.GenerateRequest(prompt="hi", max_tokens=16))
    validate(
        budget_pb2.OpenTaskRequest(
            task_id="t", limits=common_pb2.BudgetAmounts(calls=1), timeout={"seconds": 5}
        )
    )


def test_missing_required_fields_are_named():
    assert found(embedding_pb2.EmbedRequest()) == {"texts": "is required and must not be empty"}
    assert found(budget_pb2.OpenTaskRequest(task_id="t")) == {
        "limits": "is required",
        "timeout": "is required",
    }


def test_empty_item_and_oversized_item_name_their_index():
    request = embedding_pb2.EmbedRequest(texts=["ok", "", "x" * 40000])
    assert found(request) == {
        "texts[1]": "must not be empty",
        "texts[2]": "is 40000 bytes; the limit is 32768 bytes",
    }


def test_byte_limits_count_utf8_bytes_not_characters():
    request = retrieval_pb2.SearchRequest(query="é" * 2049, k=1)  # 4098 bytes
    assert "query" in found(request)


def test_too_many_items():
    request = embedding_pb2.EmbedRequest(texts=["a"] * 257)
    assert found(request) == {"texts": "has 257 items; the limit is 256"}


def test_unknown_enum_value_lists_the_valid_ones():
    request = retrieval_pb2.SearchRequest(query="q", k=1, mode=99)
    description = found(request)["mode"]
    assert description.startswith("unknown enum value 99")
    assert "SEARCH_MODE_HYBRID" in description


def test_unknown_enum_in_a_repeated_nested_message():
    request = generation_pb2.GenerateRequest(max_tokens=1)
    request.chat.messages.add(role=generation_pb2.ROLE_USER, content="hi")
    request.chat.messages.add(role=17, content="x")
    assert list(found(request)) == ["chat.messages[1].role"]


def test_required_enum_rejects_unspecified():
    request = generation_pb2.GenerateRequest(max_tokens=1)
    request.chat.messages.add(content="hi")
    assert found(request) == {
        "chat.messages[0].role": "is required; set one of ROLE_SYSTEM, ROLE_USER, ROLE_ASSISTANT"
    }


def test_numeric_bounds():
    assert found(retrieval_pb2.SearchRequest(query="q", k=1001)) == {
        "k": "is 1001; the maximum is 1000"
    }
    assert found(retrieval_pb2.SearchRequest(query="q")) == {"k": "is required; the minimum is 1"}
    assert found(retrieval_pb2.SearchRequest(query="q", k=1, vector_weight=1.5)) == {
        "vector_weight": "is 1.5; the maximum is 1"
    }


def test_required_oneof():
    assert found(generation_pb2.GenerateRequest(max_tokens=5)) == {
        "input": "is required; set one of chat, prompt"
    }


def test_nested_document_paths():
    request = retrieval_pb2.UpsertRequest()
    request.documents.add(id="a", text="t", acl=["ok", ""])
    request.documents.add(id="", text="t")
    assert found(request) == {
        "documents[0].acl[1]": "must not be empty",
        "documents[1].id": "is required and must not be empty",
    }


def test_nested_message_with_rules_inside_an_optional_message():
    request = orchestrator_pb2.AskRequest(question="q")
    request.plan.nodes.add(id="n1")  # kind missing
    assert found(request) == {
        "plan.nodes[0].kind": "is required; set one of "
        + ", ".join(
            name for name in orchestrator_pb2.NodeKind.keys() if name != "NODE_KIND_UNSPECIFIED"
        )
    }


def test_validate_raises_one_error_with_every_violation():
    with pytest.raises(InvalidArgument) as caught:
        validate(retrieval_pb2.SearchRequest(query="", k=0, mode=7))
    assert [v.field for v in caught.value.violations] == ["query", "k", "mode"]
    assert caught.value.field == "query"
    assert "k: is required" in caught.value.message


def test_check_size_names_the_largest_field():
    request = retrieval_pb2.UpsertRequest()
    for i in range(10):
        request.documents.add(id=str(i), text="x" * 1000)
    check_size(request, 100_000)
    with pytest.raises(InvalidArgument) as caught:
        check_size(request, 5000)
    assert caught.value.field == "documents"
    assert "limit of 5000 bytes" in caught.value.message


def test_only_what_has_rules_is_walked_item_by_item():
    from google.protobuf import timestamp_pb2

    from ragline.validation import _checks_for, _has_checks

    document = retrieval_pb2.UpsertRequest.DESCRIPTOR.fields_by_name["documents"].message_type
    checks = {c.field.name: c for c in _checks_for(document).fields}
    assert not checks["vector"].items_checked  # floats without rules: not visited one by one
    assert checks["acl"].items_checked
    assert _has_checks(document)
    assert not _has_checks(timestamp_pb2.Timestamp.DESCRIPTOR)
    # and a violation deep inside a repeated message is still found
    request = retrieval_pb2.UpsertRequest()
    request.documents.add(id="a", text="ok", vector=[0.1] * 384)
    request.documents.add(id="", text="ok", acl=[""])
    assert set(found(request)) == {"documents[1].id", "documents[1].acl[0]"}


def test_nan_and_infinity_are_refused_wherever_a_number_goes():
    nan, inf = float("nan"), float("inf")
    # NaN passes every min/max comparison: it is refused for what it is.
    assert found(retrieval_pb2.SearchRequest(query="q", k=1, vector_weight=nan)) == {
        "vector_weight": "is nan; it must be a finite number"
    }
    sampling = generation_pb2.GenerateRequest(prompt="p", max_tokens=1)
    sampling.sampling.temperature = inf
    assert "sampling.temperature" in found(sampling)
    # One in a vector (no rules of its own) poisons every distance: named by its index.
    search = retrieval_pb2.SearchRequest(query="q", k=1, query_vector=[0.1, 0.2, nan, 0.3])
    assert found(search) == {"query_vector[2]": "must be a finite number"}
    upsert = retrieval_pb2.UpsertRequest()
    upsert.documents.add(id="a", text="ok", vector=[0.1] * 383 + [-inf])
    assert found(upsert) == {"documents[0].vector[383]": "must be a finite number"}
    upsert.documents[0].vector[383] = 3e38  # large but finite: fine
    assert not found(upsert)
