"""OpenAI request bodies as strict Pydantic models, and their translation to SamplingParams.

Unknown top-level fields are ignored (new SDKs send new optional fields), but the types and
ranges of every field we act on are checked strictly, so bad input becomes a 400, never a 500.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationInfo, field_validator, model_validator

from fleet_base.bounds import MAX_N, MAX_STOP_TOKEN_IDS, MAX_TOKENS, Seed, TokenId, TokenLimit
from fleet_base.openai_contract.base import Strict
from fleet_base.openai_contract.structured import (
    ResponseFormat,
    Tool,
    ToolChoice,
    ToolMode,
    check_tools,
    tool_call_constraint,
    tool_mode,
)
from fleet_base.sampling_params import SamplingParams, StructuredOutput

MAX_TOP_LOGPROBS = 20
MAX_STOP_SEQUENCES = 16
Role = Literal["system", "developer", "user", "assistant", "tool"]


_Strict = Strict


class StreamOptions(_Strict):
    include_usage: bool = False


class ContentPart(_Strict):
    """A text part of a message; other part types (images, audio) are refused."""

    model_config = ConfigDict(strict=True, extra="allow")

    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> ContentPart:
        if self.type != "text":
            raise ValueError(f"content parts of type {self.type!r} are not supported; only 'text' is")
        if self.text is None:
            raise ValueError("a content part of type 'text' needs a 'text' string")
        return self


class ChatMessage(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")

    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _needs_content(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role!r} message needs 'content'")
        return self

    def to_template(self) -> dict[str, Any]:
        """The plain dict the tokenizer's chat template expects."""
        content: Any = self.content
        if isinstance(content, list):
            content = [{"type": "text", "text": part.text} for part in content]
        out: dict[str, Any] = {"role": self.role, "content": content}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _check_stop(v: object) -> object:
    if v is None or isinstance(v, str):
        v = [] if v is None else [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise ValueError("stop must be a string or a list of strings")
    if len(v) > MAX_STOP_SEQUENCES:
        raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed, got {len(v)}")
    if any(s == "" for s in v):
        raise ValueError("stop sequences must not be empty strings")
    return v


class _SamplingRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI + vLLM extras)."""

    model: str
    max_tokens: TokenLimit | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=MAX_TOKENS)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    seed: Seed | None = None
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    min_tokens: int = Field(0, ge=0, le=MAX_TOKENS)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None
    # vLLM's extra: prefix-cache blocks are shared only between requests with the same salt
    # (the fleet gateway sets it per tenant and replaces whatever a client sent).
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Fleet's continuation extension (fleet_base.openai_contract.continuation): tokens already
    # generated for this request elsewhere; prefilled after the prompt, counted as output.
    fleet_resume_token_ids: list[TokenId] | None = Field(None, max_length=MAX_TOKENS)
    logit_bias: dict[str, float] | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v: object) -> object:
        return _check_stop(v)

    @model_validator(mode="after")
    def _check_common(self) -> _SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported by this server")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must not exceed max_tokens")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def requested_max_tokens(self) -> int | None:
        """The output bound per sequence; None: up to the context window
        (`fleet_base.sampling_params.generation_limit`)."""
        return self.max_tokens

    def _params(
        self, max_tokens: int | None, logprobs: int | None, structured: StructuredOutput | None = None
    ) -> SamplingParams:
        given: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
        }
        return SamplingParams(
            n=self.n,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids or [],
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured=structured,
            **{k: v for k, v in given.items() if v is not None},
        )


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: TokenLimit | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @field_validator("tools")
    @classmethod
    def _tools_unique(cls, v: list[Tool] | None) -> list[Tool] | None:
        check_tools(v, None)
        return v

    @field_validator("tool_choice")
    @classmethod
    def _choice_matches_tools(cls, v: ToolChoice | None, info: ValidationInfo) -> ToolChoice | None:
        check_tools(info.data.get("tools"), v)
        return v

    @property
    def tool_mode(self) -> ToolMode:
        return tool_mode(self.tools, self.tool_choice)

    @property
    def feature(self) -> str:
        """What shapes the output, for metrics: tools_<mode>, json_schema, json_object or text."""
        if self.tool_mode != "none":
            return f"tools_{self.tool_mode}"
        return self.response_format.type if self.response_format is not None else "text"

    def structured_output(self) -> StructuredOutput | None:
        """A forced tool call wins over response_format (which then shapes nothing)."""
        forced = tool_call_constraint(self.tools or [], self.tool_choice, self.parallel_tool_calls)
        if forced is not None:
            return forced
        return self.response_format.structured() if self.response_format is not None else None

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template sees them (none when tool_choice is 'none')."""
        if self.tool_mode == "none":
            return None
        return [t.model_dump(exclude_none=True, by_alias=True) for t in self.tools or []]

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def sampling_params(self) -> SamplingParams:
        top = (self.top_logprobs or 0) if self.logprobs else None
        return self._params(self.requested_max_tokens, top, self.structured_output())


def _check_prompt(v: object) -> object:
    msg = "prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids"
    if isinstance(v, str):
        return v
    if not isinstance(v, list) or not v:
        raise ValueError(msg if not isinstance(v, list) else "prompt must not be an empty list")
    if all(isinstance(x, str) for x in v):
        return v
    if all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        return v
    if all(isinstance(x, list) for x in v):
        for ids in v:
            if not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValueError("each token-id prompt must be a non-empty list of integers")
        return v
    raise ValueError(msg)


class CompletionRequest(_SamplingRequest):
    prompt: Any
    max_tokens: TokenLimit | None = 16
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v: object) -> object:
        return _check_prompt(v)

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported by this server")
        if self.suffix:
            raise ValueError("suffix is not supported by this server")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of must equal n (or be omitted)")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompt as a list of single prompts (strings or token-id lists)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [p]
        return list(p)

    def sampling_params(self) -> SamplingParams:
        return self._params(self.requested_max_tokens, self.logprobs)


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' or 'messages'")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        return self


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]
