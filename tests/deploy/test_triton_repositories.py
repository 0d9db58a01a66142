"""The Triton model repositories of deploy/triton: every config parses as Triton's
ModelConfig, every ensemble's wiring holds (tests/support/triton_repository.py), and each
repository serves exactly the tensors its service's adapter sends and reads. The GPU
repositories cannot be loaded here (no GPU, no TensorRT); these checks are what catches a
broken one before a GPU node does."""

from __future__ import annotations

import shutil

import pytest

from ragline_services.embedding.triton_backend import MODEL_INPUTS, MODEL_OUTPUT
from ragline_services.generation.triton_engine import (
    ENSEMBLE_INPUTS,
    ENSEMBLE_OUTPUT,
    PREPROCESSING_COUNT_OUTPUT,
    PREPROCESSING_INPUTS,
)
from support import REPO_ROOT, load_tool
from support.triton_repository import contract_problems, load_repository, repository_problems

pytestmark = pytest.mark.deploy

TRITON = REPO_ROOT / "deploy" / "triton"
GENERATION = ["generation/cpu", "generation/gpu"]
EMBEDDING = ["embedding/cpu", "embedding/gpu", "embedding/onnx"]


@pytest.mark.parametrize("repository", GENERATION + EMBEDDING)
def test_every_config_parses_and_every_ensemble_is_wired(repository):
    assert repository_problems(TRITON / repository) == []


@pytest.mark.parametrize("repository", GENERATION)
def test_generation_repositories_serve_the_adapter_contract(repository):
    models, _ = load_repository(TRITON / repository)
    problems = contract_problems(models["ensemble"], ENSEMBLE_INPUTS, [ENSEMBLE_OUTPUT])
    problems += contract_problems(
        models["preprocessing"], PREPROCESSING_INPUTS, [PREPROCESSING_COUNT_OUTPUT]
    )
    assert problems == []


@pytest.mark.parametrize("repository", EMBEDDING)
def test_embedding_repositories_serve_the_backend_contract(repository):
    models, _ = load_repository(TRITON / repository)
    assert list(models) == ["minilm_l6"]
    assert contract_problems(models["minilm_l6"], MODEL_INPUTS, [MODEL_OUTPUT]) == []


def test_the_gpu_ensemble_runs_the_engine_decoupled_without_cross_tenant_reuse():
    models, _ = load_repository(TRITON / "generation/gpu")
    engine = models["tensorrt_llm"].config
    assert engine.backend == "tensorrtllm"
    assert engine.model_transaction_policy.decoupled  # one response per step: streaming
    parameters = {k: v.string_value for k, v in engine.parameters.items()}
    assert parameters["enable_kv_cache_reuse"] == "false"  # docs/security.md
    assert parameters["gpt_model_type"] == "inflight_fused_batching"
    steps = [s.model_name for s in models["ensemble"].config.ensemble_scheduling.step]
    assert steps == ["preprocessing", "tensorrt_llm", "postprocessing"]


def _copy(tmp_path, repository: str):
    target = tmp_path / "repo"
    shutil.copytree(TRITON / repository, target)
    return target


def _edit(path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


# Each broken copy must be caught: proof that the checks above can fail.
BREAKAGES = {
    "misspelt field": ("ensemble/config.pbtxt", "data_type: TYPE_STRING", "datatype: TYPE_STRING"),
    "unmapped tensor": (
        "ensemble/config.pbtxt",
        'key: "input_ids" value: "_INPUT_ID"',
        'key: "input_ids" value: "_INPUT_IDS"',
    ),
    "type mismatch between steps": (
        "tensorrt_llm/config.pbtxt",
        '{ name: "input_lengths" data_type: TYPE_INT32',
        '{ name: "input_lengths" data_type: TYPE_INT64',
    ),
    "unknown step input": (
        "ensemble/config.pbtxt",
        'key: "streaming" value: "stream"',
        'key: "stream" value: "stream"',
    ),
    "name not its directory": (
        "postprocessing/config.pbtxt",
        'name: "postprocessing"',
        'name: "detokenize"',
    ),
}


@pytest.mark.parametrize("breakage", BREAKAGES)
def test_a_broken_gpu_repository_is_caught(tmp_path, breakage):
    relative, old, new = BREAKAGES[breakage]
    repository = _copy(tmp_path, "generation/gpu")
    _edit(repository / relative, old, new)
    assert repository_problems(repository) != []


def test_a_contract_drift_is_caught(tmp_path):
    repository = _copy(tmp_path, "generation/gpu")
    _edit(
        repository / "ensemble/config.pbtxt",
        '{ name: "max_tokens" data_type: TYPE_UINT32',
        '{ name: "max_tokens" data_type: TYPE_INT32',
    )
    models, _ = load_repository(repository)
    problems = contract_problems(models["ensemble"], ENSEMBLE_INPUTS, [ENSEMBLE_OUTPUT])
    assert any("max_tokens" in p for p in problems)


def test_an_engine_declaration_parses_and_replaces_the_last_one(tmp_path):
    """tools/build_trt_engine.py's declaration in the GPU repository's config: Triton's
    ModelConfig reads it, and building again replaces it instead of adding one."""
    tool = load_tool("build_trt_engine")
    repository = tmp_path / "gpu"
    shutil.copytree(TRITON / "embedding" / "gpu", repository)
    config = repository / "minilm_l6" / "config.pbtxt"
    first = tool.engine_version("minilm-l6-fp32", b"plan one", fp32=False)
    second = tool.engine_version("minilm-l6-fp32", b"plan two", fp32=False)
    assert first.startswith("minilm-l6-fp32-trt-fp16@") and first != second
    config.write_text(tool.declare(config.read_text(), first, batch_invariant=True))
    config.write_text(tool.declare(config.read_text(), second, batch_invariant=True))
    models, problems = load_repository(repository)
    assert problems == []
    parameters = models["minilm_l6"].config.parameters
    assert parameters["ragline_model_version"].string_value == second
    assert parameters["ragline_batch_invariant"].string_value == "true"
    assert config.read_text().count("ragline_model_version") == 1
