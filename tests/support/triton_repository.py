"""Static checks of a Triton model repository: what tritonserver would refuse at load time
or at the first request, found without a GPU.

Every `config.pbtxt` parses as Triton's ModelConfig (an unknown field or a misspelt enum is
an error), names its own directory, and every ensemble's wiring holds: each step names a
model of the repository, maps only tensors that model declares, from tensors that exist by
then (the ensemble's inputs or an earlier step's outputs), with the same data type; every
required input of a step is fed, and every ensemble output is produced.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Tensor:
    name: str
    data_type: str  # TYPE_INT32, TYPE_STRING, ...
    optional: bool = False


@dataclass(frozen=True)
class Model:
    name: str
    platform: str  # backend or platform
    inputs: dict[str, Tensor]
    outputs: dict[str, Tensor]
    config: object  # the parsed ModelConfig


def load_repository(root: Path) -> tuple[dict[str, Model], list[str]]:
    """The models of a repository by name, and what is wrong with their configs."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    data_type = model_config_pb2.DataType.Name
    models, problems = {}, []
    for path in sorted(root.glob("*/config.pbtxt")):
        config = model_config_pb2.ModelConfig()
        try:
            text_format.Parse(path.read_text(), config)
        except text_format.ParseError as error:
            problems.append(f"{path.relative_to(root)}: {error}")
            continue
        if config.name != path.parent.name:
            problems.append(f"{path.relative_to(root)}: name {config.name!r} is not its directory")
        if not (config.backend or config.platform):
            problems.append(f"{config.name}: neither backend nor platform")
        models[config.name] = Model(
            name=config.name,
            platform=config.platform or config.backend,
            inputs={
                t.name: Tensor(t.name, data_type(t.data_type), t.optional) for t in config.input
            },
            outputs={t.name: Tensor(t.name, data_type(t.data_type)) for t in config.output},
            config=config,
        )
    return models, problems


def ensemble_problems(models: dict[str, Model]) -> list[str]:
    problems = []
    for ensemble in models.values():
        if ensemble.platform != "ensemble":
            continue
        available = dict(ensemble.inputs)  # tensor name -> Tensor, as the steps run
        for number, step in enumerate(ensemble.config.ensemble_scheduling.step):
            where = f"{ensemble.name} step {number} ({step.model_name})"
            model = models.get(step.model_name)
            if model is None:
                problems.append(f"{where}: no such model in the repository")
                continue
            for key, source in step.input_map.items():
                wanted = model.inputs.get(key)
                if wanted is None:
                    problems.append(f"{where}: {step.model_name} has no input {key!r}")
                elif source not in available:
                    problems.append(f"{where}: {source!r} does not exist before this step")
                elif available[source].data_type != wanted.data_type:
                    problems.append(
                        f"{where}: {source!r} is {available[source].data_type}, "
                        f"{key!r} wants {wanted.data_type}"
                    )
            for name, tensor in model.inputs.items():
                if not tensor.optional and name not in step.input_map:
                    problems.append(f"{where}: required input {name!r} is not fed")
            for key, target in step.output_map.items():
                produced = model.outputs.get(key)
                if produced is None:
                    problems.append(f"{where}: {step.model_name} has no output {key!r}")
                    continue
                declared = ensemble.outputs.get(target)
                if declared is not None and declared.data_type != produced.data_type:
                    problems.append(
                        f"{where}: {key!r} is {produced.data_type}, the ensemble's "
                        f"{target!r} is {declared.data_type}"
                    )
                available[target] = Tensor(target, produced.data_type)
        for name in ensemble.outputs:
            if name not in available:
                problems.append(f"{ensemble.name}: output {name!r} is produced by no step")
    return problems


def kserve_type(data_type: str) -> str:
    """Triton's config type -> the KServe v2 datatype a client sends (TYPE_STRING = BYTES)."""
    name = data_type.removeprefix("TYPE_")
    return "BYTES" if name == "STRING" else name


def contract_problems(model: Model, inputs: dict[str, str], outputs: list[str]) -> list[str]:
    """What a client sending `inputs` (name -> KServe datatype) and reading `outputs` would
    be refused by `model`."""
    problems = []
    for name, datatype in inputs.items():
        declared = model.inputs.get(name)
        if declared is None:
            problems.append(f"{model.name}: the client sends {name!r}, which it does not declare")
        elif kserve_type(declared.data_type) != datatype:
            problems.append(
                f"{model.name}: the client sends {name!r} as {datatype}, "
                f"it declares {declared.data_type}"
            )
    for name, declared in model.inputs.items():
        if not declared.optional and name not in inputs:
            problems.append(f"{model.name}: requires {name!r}, which the client never sends")
    for name in outputs:
        if name not in model.outputs:
            problems.append(f"{model.name}: the client reads {name!r}, which it does not produce")
    return problems


def repository_problems(root: Path) -> list[str]:
    models, problems = load_repository(root)
    return problems + ensemble_problems(models)
