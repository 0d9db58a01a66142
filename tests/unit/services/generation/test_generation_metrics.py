"""Generation's counters split into kinds that do not overlap (sum() is every token), and
decode is timed per output token."""

from __future__ import annotations

from ragline.metrics import ProcessMetrics
from ragline.vocabulary import ModelTier
from ragline_services.generation.generator import Summary
from ragline_services.generation.metrics import GenerationMetrics


def summary(**fields) -> Summary:
    values = dict(
        finish_reason="stop", text="x", prompt_tokens=500, completion_tokens=11,
        cached_tokens=300, queue_wait_s=0.0, prefill_s=0.2, decode_s=0.5,
        first_token_at=None, model="m", model_version="v", tier=ModelTier.SMALL,
        speculation_mode="ngram", drafted=40, accepted=30, fell_back=False,
    )  # fmt: skip
    values.update(fields)
    return Summary(**values)


def sample(process: ProcessMetrics, name: str, **labels: str) -> float:
    value = process.registry.get_sample_value(name, {"tier": "small", **labels})
    return value or 0.0


def test_token_kinds_add_up_to_every_token_and_decode_is_time_per_token():
    process = ProcessMetrics()
    GenerationMetrics(process).record(summary(), first_token_s=0.3)
    tokens = {
        kind: sample(process, "ragline_generation_tokens_total", kind=kind)
        for kind in ("prompt_computed", "prompt_cached", "completion")
    }
    assert tokens == {"prompt_computed": 200, "prompt_cached": 300, "completion": 11}
    spec = {
        result: sample(process, "ragline_generation_speculation_tokens_total", result=result)
        for result in ("accepted", "rejected")
    }
    assert spec == {"accepted": 30, "rejected": 10}  # the 40 drafted, split
    tpot = "ragline_generation_time_per_output_token_seconds"
    assert sample(process, f"{tpot}_sum") == 0.05  # 0.5 s over the 10 tokens after the first
    assert sample(process, f"{tpot}_count") == 1
