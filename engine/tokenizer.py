"""The model's tokenizer and chat template, built from the same files as its weights.

Encoding runs on the `tokenizers` library (fast, batched); decoding of byte-level BPE and
SentencePiece vocabularies is done here from a per-token byte table, so that streaming
(`IncrementalDetokenizer`), logprob token texts and whole-sequence `decode` agree exactly.
No torch and no transformers: the gateway process imports this module.
"""

from __future__ import annotations

import codecs
import json
import logging
import mmap
import re
import struct
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _Backend

log = logging.getLogger(__name__)

__all__ = ["ChatTemplateError", "IncrementalDetokenizer", "Tokenizer"]


class ChatTemplateError(ValueError):
    """Messages the template cannot render, or the template's own `raise_exception`."""


# GGUF token types (llama.cpp `llama_token_type`).
_TT_NORMAL, _TT_UNKNOWN, _TT_CONTROL, _TT_USER_DEFINED, _TT_UNUSED, _TT_BYTE = 1, 2, 3, 4, 5, 6

# End-of-turn / end-of-text tokens of common chat models; stop tokens when special in the vocab.
_END_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end|>",
    "</s>",
    "<|END_OF_TURN_TOKEN|>",
)

# Pre-tokenizer regexes by `tokenizer.ggml.pre` (same patterns as llama.cpp / the HF originals).
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DIGIT_SPLIT_PRES = {"smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva"}
_GPT2_PRES = {"default", "gpt2", "gpt-2", "mpt", "olmo", "jais", "phi-2", "poro-chat", "bloom"}

_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# --------------------------------------------------------------------------- byte tables


@lru_cache(maxsize=1)
def _byte_level_decoding_map() -> dict[str, int]:
    """GPT-2 byte-level alphabet: printable Latin-1 bytes stand for themselves, the other
    bytes are shifted to code points 256+ so every byte has a visible character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    mapping: dict[str, int] = {chr(b): b for b in printable}
    shift = 0
    for b in range(256):
        if b not in printable:
            mapping[chr(256 + shift)] = b
            shift += 1
    return mapping


@lru_cache(maxsize=1)
def _byte_level_translation() -> dict[int, int]:
    return {ord(ch): b for ch, b in _byte_level_decoding_map().items()}


# Characters below U+0100 that are not in the byte-level alphabet (they stand for nothing).
_NOT_BYTE_LEVEL = re.compile("[\x00-\x20\x7f-\xa0\xad]")


def _byte_level_bytes(piece: str) -> bytes:
    if not _NOT_BYTE_LEVEL.search(piece):
        try:
            return piece.translate(_byte_level_translation()).encode("latin-1")
        except UnicodeEncodeError:
            pass
    return piece.encode("utf-8")  # not a byte-level string (same fallback as `tokenizers`)


def _sentencepiece_bytes(piece: str) -> bytes:
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            pass
    return piece.replace("▁", " ").encode("utf-8")


def _build_byte_table(pieces: Sequence[str], added: Mapping[int, str], kind: str) -> list[bytes]:
    """Raw bytes of every token id; added tokens are their literal text."""
    convert = _byte_level_bytes if kind == "byte_level" else _sentencepiece_bytes
    table = [convert(p) for p in pieces]
    for i, content in added.items():
        if i >= len(table):
            table.extend([b""] * (i + 1 - len(table)))
        table[i] = content.encode("utf-8")
    return table


# --------------------------------------------------------------------------- GGUF metadata


_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _parse_gguf_kv(buf: memoryview) -> dict[str, Any]:
    """The key-value section of a little-endian GGUF v2/v3 file, with the stdlib only:
    GGUFReader also maps every tensor and array element (~2 s for a 49k vocabulary)."""
    if bytes(buf[:4]) != b"GGUF" or struct.unpack_from("<I", buf, 4)[0] not in (2, 3):
        raise ValueError("not a little-endian GGUF v2/v3 file")
    n_kv = struct.unpack_from("<Q", buf, 16)[0]
    pos = 24

    def string() -> str:
        nonlocal pos
        (n,) = struct.unpack_from("<Q", buf, pos)
        pos += 8 + n
        return bytes(buf[pos - n : pos]).decode("utf-8", errors="replace")

    def value(vtype: int) -> Any:
        nonlocal pos
        if vtype == _GGUF_STRING:
            return string()
        if vtype == _GGUF_ARRAY:
            item_type, count = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            if item_type in _GGUF_SCALARS:
                fmt = f"<{count}{_GGUF_SCALARS[item_type]}"
                items = list(struct.unpack_from(fmt, buf, pos))
                pos += struct.calcsize(fmt)
                return items
            return [value(item_type) for _ in range(count)]
        fmt = "<" + _GGUF_SCALARS[vtype]
        (out,) = struct.unpack_from(fmt, buf, pos)
        pos += struct.calcsize(fmt)
        return out

    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = string()
        (vtype,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        meta[key] = value(vtype)
    return meta


def _read_gguf_metadata_with_gguf(path: Path) -> dict[str, Any]:
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def _read_gguf_metadata(path: Path) -> dict[str, Any]:
    """GGUF metadata; the `gguf` package reads what the fast parser does not handle."""
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        view = memoryview(mm)
        try:
            return _parse_gguf_kv(view)
        except (ValueError, KeyError, struct.error):
            pass
        finally:
            view.release()
    return _read_gguf_metadata_with_gguf(path)


def _gpt2_pre_tokenizer(pre: str) -> tuple[Any, Any]:
    """(normalizer, pre_tokenizer) for a byte-level BPE named by `tokenizer.ggml.pre`."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in _DIGIT_SPLIT_PRES:
        digits = pre_tokenizers.Digits(individual_digits=True)
        return None, pre_tokenizers.Sequence(
            [digits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        )
    if pre in {"llama-bpe", "llama3", "falcon3", "smaug-bpe", "dbrx"}:
        split = pre_tokenizers.Split(Regex(_LLAMA3_PATTERN), behavior="isolated", invert=False)
        return None, pre_tokenizers.Sequence([split, byte_level])
    if pre in {"qwen2", "qwen35"}:
        split = pre_tokenizers.Split(Regex(_QWEN2_PATTERN), behavior="isolated", invert=False)
        return normalizers.NFC(), pre_tokenizers.Sequence([split, byte_level])
    if pre not in _GPT2_PRES:
        log.warning("unknown GGUF pre-tokenizer %r: using the GPT-2 regex", pre)
    return None, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _sentencepiece_merges(pieces: Sequence[str], scores: Sequence[float], types: Sequence[int]):
    """BPE merges equivalent to SentencePiece's greedy highest-score-pair merging: a pair
    (a, b) merges when a+b is a normal token, ranked by the merged token's score."""
    vocab = {p: i for i, p in enumerate(pieces)}
    ranked: list[tuple[float, int, tuple[str, str]]] = []
    for i, piece in enumerate(pieces):
        if types[i] != _TT_NORMAL or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], i, (left, right)))
    ranked.sort()
    return [pair for _, _, pair in ranked]


# --------------------------------------------------------------------------- chat template


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """HF's `tojson` filter: unlike Jinja's built-in it keeps non-ASCII and HTML as is."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=1)
def _jinja_env() -> Any:
    """The sandbox HF renders chat templates in, plus a pass-through `{% generation %}` tag."""
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """HF's assistant-mask marker: renders its body unchanged (we need no masks)."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@lru_cache(maxsize=32)
def _compile_template(source: str) -> Any:
    import jinja2

    try:
        return _jinja_env().from_string(source)
    except jinja2.TemplateError as err:
        raise ChatTemplateError(f"the model's chat template does not compile: {err}") from err


def _flatten_content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts: list[str] = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, Mapping) and part.get("type", "text") == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise ChatTemplateError(f"{where}.content[{j}].text must be a string")
                texts.append(text)
            else:
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ChatTemplateError(
                    f"{where}.content[{j}] of type {kind!r} is not supported: only text parts are"
                )
        return "\n".join(texts)
    raise ChatTemplateError(f"{where}.content must be a string or a list of text parts")


def _normalize_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """Copy tool calls, parsing JSON-string arguments into objects as templates expect."""
    if not isinstance(calls, list):
        raise ChatTemplateError(f"{where}.tool_calls must be a list")
    out = []
    for call in calls:
        if not isinstance(call, Mapping):
            raise ChatTemplateError(f"{where}.tool_calls entries must be objects")
        call = dict(call)
        fn = call.get("function")
        if isinstance(fn, Mapping) and isinstance(fn.get("arguments"), str):
            fn = dict(fn)
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except json.JSONDecodeError:
                pass  # leave unparsable arguments as the string the client sent
            call["function"] = fn
        out.append(call)
    return out


def _normalize_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list):
        raise ChatTemplateError("messages must be a list of message objects")
    if not messages:
        raise ChatTemplateError("messages must contain at least one message")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"{where} must be an object with 'role' and 'content'")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ChatTemplateError(f"{where}.role must be a non-empty string")
        msg = dict(message)
        if msg.get("tool_calls") is not None:
            msg["tool_calls"] = _normalize_tool_calls(msg["tool_calls"], where)
        content = msg.get("content")
        if content is None:
            if msg.get("tool_calls") is None:
                raise ChatTemplateError(f"{where}.content is required")
            msg["content"] = ""
        else:
            msg["content"] = _flatten_content(content, where)
        out.append(msg)
    return out


# --------------------------------------------------------------------------- the tokenizer


def _token_str(value: Any) -> str | None:
    """A special-token entry of tokenizer_config.json: a string or {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _decoder_kind(decoder: Any) -> tuple[str | None, bool]:
    """Whether a tokenizer.json decoder is plain byte-level or SentencePiece style, so the
    byte table reproduces it; (None, _) means: let `tokenizers` decode."""
    if not isinstance(decoder, Mapping):
        return None, False
    steps = decoder.get("decoders") if decoder.get("type") == "Sequence" else [decoder]
    types = [d.get("type") for d in steps or []]
    if types == ["ByteLevel"]:
        return "byte_level", False
    if types[:3] == ["Replace", "ByteFallback", "Fuse"] and len(types) in (3, 4):
        replace = steps[0]
        if replace.get("pattern", {}).get("String") != "▁" or replace.get("content") != " ":
            return None, False
        if len(types) == 3:
            return "sentencepiece", False
        strip = steps[3]
        if strip.get("type") == "Strip" and strip.get("content") == " " and strip.get("start") == 1:
            if strip.get("stop", 0) == 0:
                return "sentencepiece", True
    return None, False


class Tokenizer:
    """Encode/decode and chat templating for one model; build with `from_path`."""

    def __init__(
        self,
        backend: _Backend,
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
        for text in _END_TOKENS:
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
        meta = _read_gguf_metadata(Path(path))
        kind = meta.get("tokenizer.ggml.model")
        pieces: list[str] = list(meta.get("tokenizer.ggml.tokens") or [])
        if not pieces:
            raise ValueError(f"{path}: GGUF has no tokenizer.ggml.tokens")
        types = list(meta.get("tokenizer.ggml.token_type") or [_TT_NORMAL] * len(pieces))
        control = {i for i, t in enumerate(types) if t == _TT_CONTROL}
        user = {i for i, t in enumerate(types) if t == _TT_USER_DEFINED}

        def tid(key: str) -> int | None:
            value = meta.get(f"tokenizer.ggml.{key}")
            return int(value) if value is not None and 0 <= int(value) < len(pieces) else None

        unk = tid("unknown_token_id")
        if kind == "gpt2":
            vocab = {p: i for i, p in enumerate(pieces)}
            merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
            backend = _Backend(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
            normalizer, pre = _gpt2_pre_tokenizer(str(meta.get("tokenizer.ggml.pre", "default")))
            if normalizer is not None:
                backend.normalizer = normalizer
            backend.pre_tokenizer = pre
            backend.decoder = decoders.ByteLevel()
            table_kind, strip, default_bos = "byte_level", False, False
        elif kind == "llama":
            scores = list(meta.get("tokenizer.ggml.scores") or [0.0] * len(pieces))
            vocab = {p: i for i, p in enumerate(pieces)}
            unk_piece = pieces[unk] if unk is not None else None
            backend = _Backend(
                models.BPE(
                    vocab=vocab,
                    merges=_sentencepiece_merges(pieces, scores, types),
                    unk_token=unk_piece,
                    fuse_unk=True,
                    byte_fallback=True,
                )
            )
            strip = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
            steps = [normalizers.Prepend("▁")] if strip else []
            backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
            backend.decoder = decoders.Sequence(
                [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
                + ([decoders.Strip(" ", 1, 0)] if strip else [])
            )
            table_kind, default_bos = "sentencepiece", True
            if unk is not None:
                control.add(unk)
        else:
            raise ValueError(f"{path}: tokenizer model {kind!r} is not supported (only 'gpt2' and 'llama')")
        backend.add_special_tokens(
            [AddedToken(pieces[i], special=True, normalized=False) for i in sorted(control)]
        )
        backend.add_tokens([AddedToken(pieces[i], special=False, normalized=False) for i in sorted(user)])

        templates = {
            k.removeprefix("tokenizer.chat_template."): v
            for k, v in meta.items()
            if k.startswith("tokenizer.chat_template.") and isinstance(v, str)
        }
        stops = {i for i in (tid("eot_token_id"), tid("eom_token_id")) if i is not None}
        added = {i: pieces[i] for i in control | user}
        return cls(
            backend,
            bos_token_id=tid("bos_token_id"),
            eos_token_id=tid("eos_token_id"),
            pad_token_id=tid("padding_token_id"),
            unk_token_id=unk,
            add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", default_bos)),
            add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
            chat_template=meta.get("tokenizer.chat_template"),
            named_templates=templates,
            special_ids=control,
            extra_stop_ids=stops,
            byte_table=_build_byte_table(pieces, added, table_kind),
            strip_leading_space=strip,
            vocab_size=len(pieces),  # duplicate token strings must not shrink it
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path).expanduser()
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(
                f"{path} has no tokenizer.json (slow SentencePiece-only tokenizers are not supported)"
            )
        raw = tok_file.read_text(encoding="utf-8")
        spec = json.loads(raw)
        backend = _Backend.from_str(raw)
        config = _read_json(path / "tokenizer_config.json")
        special_map = _read_json(path / "special_tokens_map.json")
        gen_config = _read_json(path / "generation_config.json")
        model_config = _read_json(path / "config.json")

        added_specs = spec.get("added_tokens") or []
        special_ids = {int(t["id"]) for t in added_specs if t.get("special")}
        for key, entry in (config.get("added_tokens_decoder") or {}).items():
            if isinstance(entry, Mapping) and entry.get("special"):
                special_ids.add(int(key))

        def named_id(name: str) -> int | None:
            text = _token_str(config.get(name)) or _token_str(special_map.get(name))
            return backend.token_to_id(text) if text is not None else None

        def first_id(value: Any) -> int | None:
            if isinstance(value, list):
                return int(value[0]) if value else None
            return int(value) if isinstance(value, int) else None

        bos = named_id("bos_token")
        if bos is None:
            bos = first_id(gen_config.get("bos_token_id", model_config.get("bos_token_id")))
        eos = named_id("eos_token")
        gen_eos = gen_config.get("eos_token_id", model_config.get("eos_token_id"))
        if eos is None:
            eos = first_id(gen_eos)
        pad = named_id("pad_token")
        if pad is None:
            pad = first_id(gen_config.get("pad_token_id"))
        unk = named_id("unk_token")
        extra_stops = set(
            gen_eos if isinstance(gen_eos, list) else [gen_eos] if isinstance(gen_eos, int) else []
        )

        add_bos, add_eos = config.get("add_bos_token"), config.get("add_eos_token")
        if add_bos is None or add_eos is None:  # infer from what the post-processor adds
            probe = backend.encode("a", add_special_tokens=True).ids
            bare = backend.encode("a", add_special_tokens=False).ids
            if add_bos is None:
                add_bos = bos is not None and len(probe) > len(bare) and probe[0] == bos
            if add_eos is None:
                add_eos = eos is not None and len(probe) > len(bare) and probe[-1] == eos

        template, named = cls._hf_templates(path, config)
        kind, strip = _decoder_kind(spec.get("decoder"))
        table = None
        if kind is not None:
            added = {int(t["id"]): t["content"] for t in added_specs}
            size = backend.get_vocab_size(with_added_tokens=True)
            pieces = [backend.id_to_token(i) or "" for i in range(size)]
            table = _build_byte_table(pieces, added, kind)
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_id=eos,
            pad_token_id=pad,
            unk_token_id=unk,
            add_bos_token=bool(add_bos),
            add_eos_token=bool(add_eos),
            chat_template=template,
            named_templates=named,
            special_ids=special_ids,
            extra_stop_ids=extra_stops,
            byte_table=table,
            strip_leading_space=strip,
        )

    @staticmethod
    def _hf_templates(path: Path, config: Mapping[str, Any]) -> tuple[str | None, dict[str, str]]:
        jinja_file = path / "chat_template.jinja"
        if jinja_file.is_file():
            return jinja_file.read_text(encoding="utf-8"), {}
        value = config.get("chat_template")
        if value is None:
            value = _read_json(path / "chat_template.json").get("chat_template")
        if isinstance(value, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t["name"]: t["template"] for t in value if isinstance(t, Mapping)}
            return named.pop("default", None), named
        return (value if isinstance(value, str) else None), {}

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
    def backend(self) -> _Backend:
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
        import jinja2

        msgs = _normalize_messages(messages)
        if tools is not None and (
            not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools)
        ):
            raise ChatTemplateError("tools must be a list of objects")
        source = self.chat_template
        if tools and "tool_use" in self._named_templates:
            source = self._named_templates["tool_use"]
        template = _compile_template(source or _CHATML_TEMPLATE)
        context = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            "pad_token": self.pad_token or "",
            "unk_token": self.unk_token or "",
            **kwargs,
            "messages": msgs,
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return template.render(**context)
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError, KeyError, IndexError, AttributeError, ValueError) as err:
            raise ChatTemplateError(f"chat template failed on these messages: {err}") from err

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kw: Any) -> list[int]:
        """Template then encode; BOS is added only if the model wants it and the template
        did not already write it."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kw)
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if self.add_bos_token and not (self.bos_token and text.startswith(self.bos_token)):
            ids.insert(0, self.bos_token_id)  # type: ignore[arg-type]
        return ids


# --------------------------------------------------------------------------- streaming


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
