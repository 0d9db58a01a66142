"""The HTTP request bodies of the OpenAI-compatible routes (pydantic: FastAPI validates
them and writes their schema into the OpenAPI file) and the model names the gateway serves.

Fields OpenAI clients send that do not apply to an answer from documents (`temperature`,
`top_p`, `seed`, `user`, ...) are accepted and ignored, as vLLM and LiteLLM do, so a client
written for OpenAI works unchanged; a request ragline cannot honour (`n` > 1, tools) is
refused by name instead of answered differently from what it asked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ragline.vocabulary import CachePolicy, ModelTier, SearchMode


@dataclass(frozen=True)
class ServedModel:
    """A `model` name of the chat route: a tier (None: the router's choice, which may
    escalate) and a plan."""

    name: str
    tier: ModelTier | None
    agent: bool
    description: str


SERVED_MODELS: dict[str, ServedModel] = {
    model.name: model
    for model in (
        ServedModel(
            "ragline",
            None,
            False,
            "retrieve, answer with the small tier, escalate to the large tier on a "
            "checkable signal; an agent plan for a question that joins several",
        ),
        ServedModel("ragline-small", ModelTier.SMALL, False, "the small tier only"),
        ServedModel("ragline-large", ModelTier.LARGE, False, "the large tier only"),
        ServedModel(
            "ragline-agent",
            None,
            True,
            "a planning call writes the lookups, they run in parallel, one synthesis answers",
        ),
    )
}


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str = ""


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    # A string, or a list of content parts of which the text parts are read.
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if part.type == "text")


class ChatBudget(BaseModel):
    """Task limits (unset: the server's defaults)."""

    model_config = ConfigDict(extra="forbid")

    input_tokens: int | None = Field(None, ge=0)
    output_tokens: int | None = Field(None, ge=0)
    cost_micros: int | None = Field(None, ge=0)
    calls: int | None = Field(None, ge=0)


class RaglineChatOptions(BaseModel):
    """The `ragline` extension of a chat request (the OpenAI SDK: `extra_body`)."""

    model_config = ConfigDict(extra="forbid")

    task_id: str = Field("", max_length=128, description="Join this task's budget")
    budget: ChatBudget | None = None
    allow_degrade: bool = Field(False, description="Optional steps may be dropped in time")
    mode: SearchMode | None = Field(None, description="Search mode (default: hybrid)")
    cache: CachePolicy = CachePolicy.USE
    max_evidence_tokens: int = Field(0, ge=0, le=32768)
    sources_in_content: bool = Field(
        True,
        description="Append a `sources:` list to the content (clients that read only the "
        "content, LangChain's ChatOpenAI, see the sources too)",
    )


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = Field(..., description="One of GET /v1/models")
    messages: list[ChatMessage] = Field(..., min_length=1)
    stream: bool = False
    max_tokens: int | None = Field(None, ge=1, le=8192)
    max_completion_tokens: int | None = Field(None, ge=1, le=8192)
    n: int = Field(1, ge=1)
    tools: list[dict] | None = None
    stream_options: dict | None = None
    ragline: RaglineChatOptions = Field(default_factory=RaglineChatOptions)


class RaglineEmbeddingOptions(BaseModel):
    """The `ragline` extension of an embeddings request."""

    model_config = ConfigDict(extra="forbid")

    input_type: Literal["query", "passage"] = Field(
        "query", description="Embed as a question (`query:`) or as a stored text (`passage:`)"
    )


class EmbeddingsRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    input: str | list[str] = Field(..., description="A text, or a list of texts")
    model: str = Field("", description="An embedding model of the service; empty: its default")
    dimensions: int | None = Field(None, ge=1, le=8192)
    encoding_format: Literal["float", "base64"] = "float"
    ragline: RaglineEmbeddingOptions = Field(default_factory=RaglineEmbeddingOptions)
