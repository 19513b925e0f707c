"""OpenAI request bodies (pydantic) and the error object.

Unknown fields are accepted and ignored, as vLLM does, so clients that send extra
OpenAI fields keep working; wrong types and out-of-range values are 400s.
"""
from __future__ import annotations

from http import HTTPStatus
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator

from kvrelay.sampling_params import INT64_MAX, INT64_MIN

_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
                404: "NotFoundError", 405: "MethodNotAllowedError", 413: "RequestTooLarge",
                422: "UnprocessableEntityError", 429: "RateLimitError", 500: "InternalServerError",
                503: "ServiceUnavailableError"}


def error_type_for(status: int) -> str:
    """OpenAI's error `type` for an HTTP status (e.g. 404 → NotFoundError)."""
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    try:
        return HTTPStatus(status).phrase.title().replace(" ", "").replace("-", "") + "Error"
    except ValueError:
        return "APIError"


class OpenAIError(Exception):
    """A client mistake (4xx) rendered as `{"error": {message, type, param, code}}`."""

    def __init__(self, message: str, status: int = 400, type_: str = "BadRequestError",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param = message, status, type_, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.status}}


def _thinking_token_budget(value: Any) -> int | None:
    """vLLM's `thinking_token_budget`: a JSON integer ≥ 0, or -1 (no budget of its own);
    true / 1.5 / "8" are refused rather than read as numbers."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise ValueError(f"expected an integer >= 0, or -1 for no budget of its own; "
                         f"got {value!r}")
    return value


# the most tokens of the analysis message under enforcement (tool_choice required / named, a
# response format): kvrelay/structured/manager.py `requested_budget`; docs/agents.md
ThinkingTokenBudget = Annotated[int | None, BeforeValidator(_thinking_token_budget)]


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    kv_transfer_params: dict[str, Any] | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None   # token id (as a string, as OpenAI) -> bias
    best_of: int | None = Field(None, ge=1)      # only 1 is served (as vLLM's V1 engine)
    # structured outputs (kvrelay/server/structured.py): OpenAI's, vLLM's, vLLM's older names
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int | None) -> int | None:
        if v == 0:
            return -1
        return v


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0)
    prompt_logprobs: int | None = Field(None, ge=0)
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    name: str | None = None


class ReasoningConfig(BaseModel):
    """OpenRouter's `reasoning` request object, which OpenAI's gpt-oss guide asks implementers
    to follow: `effort` is `reasoning_effort`, `max_tokens` is `thinking_token_budget`,
    `exclude` leaves the reasoning out of the answer (it still happens and is counted)."""
    model_config = ConfigDict(extra="forbid")

    effort: Literal["low", "medium", "high"] | None = None
    max_tokens: int | None = Field(None, ge=0)
    exclude: bool = False
    enabled: bool | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    thinking_token_budget: ThinkingTokenBudget = None
    reasoning: ReasoningConfig | None = None
    add_generation_prompt: bool = True
    # function calling (validated in kvrelay/server/tools.py, which names the bad entry)
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def resolve_reasoning(body: ChatCompletionRequest) -> bool:
    """Fold OpenRouter's `reasoning` object into vLLM's fields (`reasoning_effort`,
    `thinking_token_budget`); True when the answer leaves the reasoning out. Two fields that
    disagree, or reasoning turned off (gpt-oss always reasons), are 400s naming the field."""
    r = body.reasoning
    if r is None:
        return False
    if r.enabled is False:
        raise OpenAIError("reasoning.enabled: gpt-oss always reasons; lower it with "
                          "reasoning.effort \"low\" or hide it with reasoning.exclude",
                          param="reasoning.enabled")
    if r.effort is not None:
        if body.reasoning_effort not in (None, r.effort):
            raise OpenAIError(f"reasoning.effort {r.effort!r} contradicts reasoning_effort "
                              f"{body.reasoning_effort!r}", param="reasoning.effort")
        body.reasoning_effort = r.effort
    if r.max_tokens is not None:
        if body.thinking_token_budget not in (None, r.max_tokens):
            raise OpenAIError(f"reasoning.max_tokens {r.max_tokens} contradicts "
                              f"thinking_token_budget {body.thinking_token_budget}",
                              param="reasoning.max_tokens")
        body.thinking_token_budget = r.max_tokens
    return r.exclude


def without_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    """A chat message or delta with its reasoning fields taken out (`reasoning.exclude`)."""
    return {k: v for k, v in message.items() if k not in ("reasoning", "reasoning_content")}


def message_text(message: ChatMessage) -> str:
    """A message's text: a string, or the text parts of a content list."""
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    parts = []
    for part in message.content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise OpenAIError("only text content parts are supported", param="messages")
        parts.append(part["text"])
    return "".join(parts)
