"""The model's tokenizer: encode, decode and chat templating, built from the same files as
its weights (a .gguf file or a Hugging Face directory).

Encoding runs on the `tokenizers` library (fast, batched); decoding of byte-level BPE and
SentencePiece vocabularies is done from a per-token byte table, so that streaming
(`engine.detokenizer.IncrementalDetokenizer`), logprob token texts and whole-sequence
`decode` agree exactly. The vocabulary is built in `engine.model_files.vocab`, templates
render in `engine.model_files.chat_templates`. No torch and no transformers: the gateway
process imports this module.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from engine.detokenizer import IncrementalDetokenizer
from engine.model_files.chat_templates import ChatTemplateError, render_chat
from engine.model_files.vocab import (
    END_TOKENS,
    Backend,
    TokenizerParts,
    gguf_tokenizer_parts,
    hf_tokenizer_parts,
)

__all__ = ["ChatTemplateError", "IncrementalDetokenizer", "Tokenizer"]


class Tokenizer:
    """Encode/decode and chat templating for one model; build with `from_path`."""

    def __init__(
        self,
        backend: Backend,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        pad_token_id: int | None = None,
        unk_token_id: int | None = None,
        add_bos_token: bool = False,
        add_eos_token: bool = False,
        chat_template: str | None = None,
        named_templates: Mapping[str, str] | None = None,
        special_ids: set[int] | None = None,
        extra_stop_ids: set[int] | None = None,
        byte_table: list[bytes] | None = None,
        strip_leading_space: bool = False,
        vocab_size: int | None = None,
    ) -> None:
        backend.no_truncation()
        backend.no_padding()
        self._backend = backend
        self.vocab_size: int = vocab_size or backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.unk_token_id = unk_token_id
        self.add_bos_token = bool(add_bos_token and bos_token_id is not None)
        self.add_eos_token = bool(add_eos_token and eos_token_id is not None)
        self.chat_template = chat_template
        self._named_templates = dict(named_templates or {})
        self._byte_table = byte_table
        self._strip_leading_space = strip_leading_space

        self.bos_token = self._piece(bos_token_id)
        self.eos_token = self._piece(eos_token_id)
        self.pad_token = self._piece(pad_token_id)
        self.unk_token = self._piece(unk_token_id)
        ids = {i for i in (bos_token_id, eos_token_id, pad_token_id, unk_token_id) if i is not None}
        self.all_special_ids: set[int] = set(special_ids or ()) | ids
        stops = {eos_token_id} if eos_token_id is not None else set()
        stops |= set(extra_stop_ids or ())
        for text in END_TOKENS:
            tid = backend.token_to_id(text)
            if tid is not None and tid in self.all_special_ids:
                stops.add(tid)
        self.stop_token_ids: set[int] = stops
        self._texts_cache: dict[int, str] = {}

    def _piece(self, token_id: int | None) -> str | None:
        return None if token_id is None else self._backend.id_to_token(token_id)

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}, eos={self.eos_token!r})"

    # ---------------------------------------------------------------- construction

    @classmethod
    def _from_parts(cls, parts: TokenizerParts) -> Tokenizer:
        return cls(
            parts.backend,
            bos_token_id=parts.bos_token_id,
            eos_token_id=parts.eos_token_id,
            pad_token_id=parts.pad_token_id,
            unk_token_id=parts.unk_token_id,
            add_bos_token=parts.add_bos_token,
            add_eos_token=parts.add_eos_token,
            chat_template=parts.chat_template,
            named_templates=parts.named_templates,
            special_ids=parts.special_ids,
            extra_stop_ids=parts.extra_stop_ids,
            byte_table=parts.byte_table,
            strip_leading_space=parts.strip_leading_space,
            vocab_size=parts.vocab_size,
        )

    @classmethod
    def from_path(cls, path: str | Path) -> Tokenizer:
        """A .gguf file, a Hugging Face directory, or a directory holding one .gguf."""
        path = Path(path).expanduser()
        if path.is_file() and path.suffix == ".gguf":
            return cls.from_gguf(path)
        if path.is_dir():
            if (path / "tokenizer.json").is_file():
                return cls.from_hf_dir(path)
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return cls.from_gguf(ggufs[0])
        raise FileNotFoundError(
            f"no tokenizer at {path}: expected a .gguf file or a directory with tokenizer.json"
        )

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        return cls._from_parts(gguf_tokenizer_parts(path))

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        return cls._from_parts(hf_tokenizer_parts(path))

    # ---------------------------------------------------------------- encode / decode

    def _with_specials(self, ids: list[int], add_special_tokens: bool) -> list[int]:
        if add_special_tokens:
            if self.add_bos_token:
                ids.insert(0, self.bos_token_id)  # type: ignore[arg-type]
            if self.add_eos_token:
                ids.append(self.eos_token_id)  # type: ignore[arg-type]
        return ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Special tokens written in `text` become their ids; BOS/EOS per the model's config."""
        ids = self._backend.encode(text, add_special_tokens=False).ids
        return self._with_specials(ids, add_special_tokens)

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        """`encode` of many texts at once (parallel in the Rust backend)."""
        encodings = self._backend.encode_batch(list(texts), add_special_tokens=False)
        return [self._with_specials(e.ids, add_special_tokens) for e in encodings]

    def _skip(self, token_id: int, skip_special_tokens: bool) -> bool:
        return skip_special_tokens and token_id in self.all_special_ids

    def token_bytes(self, ids: Sequence[int]) -> list[bytes]:
        """Each token's raw bytes (added/special tokens: their literal text)."""
        table = self._byte_table
        if table is None:
            return [self._backend.decode([int(i)], skip_special_tokens=False).encode() for i in ids]
        n = len(table)
        return [table[i] if 0 <= i < n else b"" for i in ids]

    def _decode_bytes(self, data: bytes) -> str:
        text = data.decode("utf-8", errors="replace")
        if self._strip_leading_space and text.startswith(" "):
            text = text[1:]
        return text

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self._byte_table is None:
            return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        kept = [i for i in ids if not self._skip(i, skip_special_tokens)]
        return self._decode_bytes(b"".join(self.token_bytes(kept)))

    def token_texts(self, ids: Sequence[int]) -> list[str]:
        """Each token's own text for logprobs; bytes that are not UTF-8 on their own are
        written OpenAI style, e.g. "bytes:\\xe2\\x80"."""
        out = []
        for token_id in ids:
            text = self._texts_cache.get(token_id)
            if text is None:
                raw = self.token_bytes([token_id])[0]
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError:
                    text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
                self._texts_cache[token_id] = text
            out.append(text)
        return out

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    @property
    def backend(self) -> Backend:
        """The underlying `tokenizers.Tokenizer` (e.g. to save it as tokenizer.json)."""
        return self._backend

    # ---------------------------------------------------------------- chat

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render `messages` with the model's template (ChatML when it has none)."""
        source = self.chat_template
        if tools and "tool_use" in self._named_templates:
            source = self._named_templates["tool_use"]
        context = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            "pad_token": self.pad_token or "",
            "unk_token": self.unk_token or "",
            **kwargs,
        }
        return render_chat(source, messages, tools, context, add_generation_prompt)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kw: Any) -> list[int]:
        """Template then encode; BOS is added only if the model wants it and the template
        did not already write it."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kw)
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if self.add_bos_token and not (self.bos_token and text.startswith(self.bos_token)):
            ids.insert(0, self.bos_token_id)  # type: ignore[arg-type]
        return ids
