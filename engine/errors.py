"""Errors the engine raises to its callers; the server maps each to an HTTP status."""

from __future__ import annotations


class EngineError(Exception):
    """Base class of engine errors."""


class PromptTooLongError(EngineError, ValueError):
    """Prompt plus requested tokens do not fit the context window (HTTP 400)."""

    def __init__(self, num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
        self.num_prompt_tokens = num_prompt_tokens
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len
        total = num_prompt_tokens + max_tokens
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{total} tokens ({num_prompt_tokens} in the prompt, {max_tokens} for the completion). "
            "Please reduce the length of the prompt or of max_tokens."
        )


class QueueFullError(EngineError):
    """The waiting queue is full (HTTP 429 with Retry-After)."""


class EngineDeadError(EngineError):
    """The engine loop died; the replica must be restarted (HTTP 503)."""


class StepFailedError(EngineError):
    """An engine step this request was in failed; the request failed, the engine goes on
    (HTTP 500, marked so the gateway does not retry the same input on another replica)."""


class UnknownAdapterError(EngineError, ValueError):
    """The request names a LoRA adapter this engine does not have (HTTP 404 at the API)."""


class AdapterUnavailableError(EngineError):
    """This request's LoRA adapter could not be read again (its files went away); the
    request failed, the others go on (HTTP 503: another replica may serve it)."""


class StepInputError(EngineError, ValueError):
    """A step failed because of this request's input, and only this request failed (HTTP 400)."""


class SlowReaderError(EngineError):
    """The request's consumer left more output unread than the engine holds per request
    (`EngineArgs.max_unread_bytes`): the request was aborted and its resources freed. At the
    API this is the client's doing (it stopped reading), never retried elsewhere."""
