"""Vocabularies: a `tokenizers` backend, special tokens and a per-token byte table, built
from a GGUF file's metadata or a Hugging Face directory's tokenizer files.

GGUF `gpt2` (byte-level BPE) and `llama` (SentencePiece) vocabularies are rebuilt as
`tokenizers` models with the pre-tokenizer llama.cpp uses for `tokenizer.ggml.pre`; the
byte table lets decoding, streaming and logprob texts agree exactly. Torch-free.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend

from engine.model_files.chat_templates import hf_templates, read_json
from engine.model_files.gguf import read_gguf_metadata

log = logging.getLogger(__name__)

__all__ = ["END_TOKENS", "Backend", "TokenizerParts", "gguf_tokenizer_parts", "hf_tokenizer_parts"]


@dataclass
class TokenizerParts:
    """Everything `engine.tokenizer.Tokenizer` is built from."""

    backend: Backend
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None = None
    unk_token_id: int | None = None
    add_bos_token: bool = False
    add_eos_token: bool = False
    chat_template: str | None = None
    named_templates: dict[str, str] = field(default_factory=dict)
    special_ids: set[int] = field(default_factory=set)
    extra_stop_ids: set[int] = field(default_factory=set)
    byte_table: list[bytes] | None = None
    strip_leading_space: bool = False
    vocab_size: int | None = None


# GGUF token types (llama.cpp `llama_token_type`).
_TT_NORMAL, _TT_UNKNOWN, _TT_CONTROL, _TT_USER_DEFINED, _TT_UNUSED, _TT_BYTE = 1, 2, 3, 4, 5, 6

# End-of-turn / end-of-text tokens of common chat models; stop tokens when special in the vocab.
END_TOKENS = (
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


def _gguf_bpe(meta: Mapping[str, Any], pieces: list[str]) -> Backend:
    vocab = {p: i for i, p in enumerate(pieces)}
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    backend = Backend(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    normalizer, pre = _gpt2_pre_tokenizer(str(meta.get("tokenizer.ggml.pre", "default")))
    if normalizer is not None:
        backend.normalizer = normalizer
    backend.pre_tokenizer = pre
    backend.decoder = decoders.ByteLevel()
    return backend


def _gguf_sentencepiece(
    meta: Mapping[str, Any], pieces: list[str], types: list[int], unk: int | None
) -> tuple[Backend, bool]:
    """The SentencePiece vocabulary as BPE, and whether it prepends a space."""
    scores = list(meta.get("tokenizer.ggml.scores") or [0.0] * len(pieces))
    vocab = {p: i for i, p in enumerate(pieces)}
    unk_piece = pieces[unk] if unk is not None else None
    backend = Backend(
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
    return backend, strip


def gguf_tokenizer_parts(path: str | Path) -> TokenizerParts:
    """The vocabulary in a GGUF file's `tokenizer.*` metadata."""
    meta = read_gguf_metadata(Path(path))
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
        backend = _gguf_bpe(meta, pieces)
        table_kind, strip, default_bos = "byte_level", False, False
    elif kind == "llama":
        backend, strip = _gguf_sentencepiece(meta, pieces, types, unk)
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
    return TokenizerParts(
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


def _token_str(value: Any) -> str | None:
    """A special-token entry of tokenizer_config.json: a string or {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


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


def _first_id(value: Any) -> int | None:
    if isinstance(value, list):
        return int(value[0]) if value else None
    return int(value) if isinstance(value, int) else None


def _hf_special_ids(
    backend: Backend, config: Mapping[str, Any], special_map: Mapping[str, Any], gen: Mapping[str, Any]
) -> tuple[dict[str, int | None], set[int]]:
    """bos/eos/pad/unk ids (the configs' names first, then generation_config's ids) and
    the extra stop ids generation_config lists."""

    def named_id(name: str) -> int | None:
        text = _token_str(config.get(name)) or _token_str(special_map.get(name))
        return backend.token_to_id(text) if text is not None else None

    ids = {name: named_id(f"{name}_token") for name in ("bos", "eos", "pad", "unk")}
    gen_eos = gen.get("eos_token_id")
    fallbacks = {"bos": gen.get("bos_token_id"), "eos": gen_eos, "pad": gen.get("pad_token_id")}
    for name, value in fallbacks.items():
        if ids[name] is None:
            ids[name] = _first_id(value)
    extra_stops = set(gen_eos if isinstance(gen_eos, list) else [gen_eos] if isinstance(gen_eos, int) else [])
    return ids, extra_stops


def _infer_add_specials(
    backend: Backend, config: Mapping[str, Any], bos: int | None, eos: int | None
) -> tuple[bool, bool]:
    """add_bos/add_eos from tokenizer_config.json, else from what the post-processor adds."""
    add_bos, add_eos = config.get("add_bos_token"), config.get("add_eos_token")
    if add_bos is None or add_eos is None:
        probe = backend.encode("a", add_special_tokens=True).ids
        bare = backend.encode("a", add_special_tokens=False).ids
        if add_bos is None:
            add_bos = bos is not None and len(probe) > len(bare) and probe[0] == bos
        if add_eos is None:
            add_eos = eos is not None and len(probe) > len(bare) and probe[-1] == eos
    return bool(add_bos), bool(add_eos)


def hf_tokenizer_parts(path: str | Path) -> TokenizerParts:
    """The vocabulary of a Hugging Face directory (tokenizer.json and its configs)."""
    path = Path(path).expanduser()
    tok_file = path / "tokenizer.json"
    if not tok_file.is_file():
        raise FileNotFoundError(
            f"{path} has no tokenizer.json (slow SentencePiece-only tokenizers are not supported)"
        )
    raw = tok_file.read_text(encoding="utf-8")
    spec = json.loads(raw)
    backend = Backend.from_str(raw)
    config = read_json(path / "tokenizer_config.json")
    model_config = read_json(path / "config.json")
    gen = read_json(path / "generation_config.json")
    for key in ("bos_token_id", "eos_token_id"):
        if key not in gen and key in model_config:
            gen[key] = model_config[key]

    added_specs = spec.get("added_tokens") or []
    special_ids = {int(t["id"]) for t in added_specs if t.get("special")}
    for key, entry in (config.get("added_tokens_decoder") or {}).items():
        if isinstance(entry, Mapping) and entry.get("special"):
            special_ids.add(int(key))
    ids, extra_stops = _hf_special_ids(backend, config, read_json(path / "special_tokens_map.json"), gen)
    add_bos, add_eos = _infer_add_specials(backend, config, ids["bos"], ids["eos"])
    template, named = hf_templates(path, config)
    kind, strip = _decoder_kind(spec.get("decoder"))
    table = None
    if kind is not None:
        added = {int(t["id"]): t["content"] for t in added_specs}
        size = backend.get_vocab_size(with_added_tokens=True)
        pieces = [backend.id_to_token(i) or "" for i in range(size)]
        table = _build_byte_table(pieces, added, kind)
    return TokenizerParts(
        backend,
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["pad"],
        unk_token_id=ids["unk"],
        add_bos_token=add_bos,
        add_eos_token=add_eos,
        chat_template=template,
        named_templates=named,
        special_ids=special_ids,
        extra_stop_ids=extra_stops,
        byte_table=table,
        strip_leading_space=strip,
    )
