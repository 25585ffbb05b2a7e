"""Streaming detokenization: text deltas as tokens arrive, never half a UTF-8 character."""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer"]


class IncrementalDetokenizer:
    """Streams text as tokens arrive; never emits half a multi-byte UTF-8 character.

    With a byte table (byte-level BPE, SentencePiece) each push feeds only the new tokens'
    bytes to an incremental UTF-8 decoder, so the deltas concatenate to exactly
    `tokenizer.decode(ids)`. Other tokenizers decode a short sliding window (vLLM style).
    `prefix_ids` (e.g. the prompt) give context and are not emitted.
    """

    _WINDOW = 6

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        prefix_ids: Sequence[int] = (),
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._text = ""
        self._bytes_mode = tokenizer._byte_table is not None
        if self._bytes_mode:
            self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
            self._strip_pending = tokenizer._strip_leading_space and not prefix_ids
            if prefix_ids:
                self._utf8.decode(self._bytes(prefix_ids))
        else:
            self._ids: list[int] = [int(i) for i in prefix_ids]
            self._start = len(self._ids)
            self._prefix_offset = max(len(self._ids) - self._WINDOW, 0)
            self._read_offset = len(self._ids)

    @property
    def text(self) -> str:
        return self._text

    def _bytes(self, ids: Sequence[int]) -> bytes:
        tok = self._tok
        kept = [i for i in ids if not tok._skip(i, self._skip)]
        return b"".join(tok.token_bytes(kept))

    def _emit(self, delta: str) -> str:
        if delta and self._bytes_mode and self._strip_pending:
            self._strip_pending = False
            if delta.startswith(" "):
                delta = delta[1:]
        self._text += delta
        return delta

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; returns the text they complete (possibly "")."""
        if self._bytes_mode:
            return self._emit(self._utf8.decode(self._bytes(token_ids)))
        self._ids.extend(int(i) for i in token_ids)
        decode = self._tok.decode
        prefix = decode(self._ids[self._prefix_offset : self._read_offset], self._skip)
        full = decode(self._ids[self._prefix_offset :], self._skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd") and full.startswith(prefix):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return self._emit(full[len(prefix) :])
        return ""

    def flush(self) -> str:
        """Whatever is held back at the end (invalid bytes become U+FFFD)."""
        if self._bytes_mode:
            return self._emit(self._utf8.decode(b"", final=True))
        whole = self._tok.decode(self._ids[self._start :], self._skip)
        if whole.startswith(self._text):
            delta = whole[len(self._text) :]
        else:
            prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset], self._skip)
            full = self._tok.decode(self._ids[self._prefix_offset :], self._skip)
            delta = full[len(prefix) :] if full.startswith(prefix) else ""
        self._read_offset = self._prefix_offset = len(self._ids)
        return self._emit(delta)
