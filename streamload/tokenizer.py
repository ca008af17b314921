"""Tokenizers behind one interface: `encode_texts(texts) -> one id array per text`.

The loader tokenizes a fetched range's documents with one `encode_texts` call, on a transform
thread (or, with `tokenize_in="processes"`, in a process pool). What `Loader(tokenizer=...)`
accepts:

- None: one token per UTF-8 byte (handled by the transform itself, no tokenizer object);
- a callable `str -> sequence of int`, called once per document (`PerDocument`);
- a Hugging Face `tokenizers.Tokenizer`, or a `transformers` fast tokenizer (its
  `backend_tokenizer`): wrapped in `HFTokenizer`, one `encode_batch` call per range. That call
  releases the GIL and encodes on the library's own threads; a per-document `encode` does not
  release it, so transform threads calling it tokenize no faster than one
  (`benchmarks/tokenizing.py`);
- any object with an `encode_texts(list[str]) -> list[sequence of int]` method (and, if that
  runs native code that takes the GIL back, `native_calls = True`; and, so that a resume with
  another tokenizer is refused, an `identity` string, e.g. its name and version).

A tokenizer that fails on one document raises `TokenizerError` with that document's index in
the batch, so the loader can name the record (or skip it, with `on_error="skip"`).
"""
from __future__ import annotations

import hashlib
from typing import Any, Callable, Optional, Protocol, Sequence

import numpy as np

from .errors import ConfigError


class TextTokenizer(Protocol):
    # True if encode_texts runs native code that takes the GIL back: a thread must not be
    # stopped inside it (pipeline/workers.py), so closing the loader waits for such calls.
    native_calls: bool

    def encode_texts(self, texts: list[str]) -> list: ...


class TokenizerError(Exception):
    """The tokenizer failed on `texts[index]`; `done` holds the ids of the texts before it."""

    def __init__(self, index: int, reason: str, done: list):
        super().__init__(index, reason, done)
        self.index, self.reason, self.done = index, reason, done

    def __str__(self) -> str:
        return self.reason


class PerDocument:
    """A callable `str -> sequence of int`, one document at a time."""
    native_calls = False

    def __init__(self, fn: Callable[[str], Sequence[int]]):
        self.fn = fn

    @property
    def identity(self) -> str:
        """The function's qualified name: a resume with another function is refused."""
        fn = self.fn
        return f"callable {getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"

    def encode_texts(self, texts: list[str]) -> list[np.ndarray]:
        done: list[np.ndarray] = []
        for text in texts:
            try:
                done.append(np.asarray(self.fn(text)).reshape(-1))
            except Exception as exc:   # any failure names its record
                raise TokenizerError(len(done), f"tokenizer failed: {type(exc).__name__}: {exc}",
                                     done) from exc
        return done


class HFTokenizer:
    """A Hugging Face tokenizer, a range of documents per `encode_batch` call.

    `tokenizer`: a `tokenizers.Tokenizer`, or a `transformers` fast tokenizer (its
    `backend_tokenizer` is used). `add_special_tokens` is passed on (the libraries' default,
    True: the post-processor's BOS/CLS and the like); `eos_id`, if given, is appended to every
    document."""
    native_calls = True

    def __init__(self, tokenizer: Any, *, add_special_tokens: bool = True,
                 eos_id: Optional[int] = None):
        backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        if not is_hf_tokenizer(backend):
            raise ConfigError(f"tokenizer: expected a tokenizers.Tokenizer or a transformers fast "
                              f"tokenizer, got {type(tokenizer).__name__}")
        if eos_id is not None and (isinstance(eos_id, bool) or not isinstance(eos_id, int)
                                   or eos_id < 0):
            raise ConfigError(f"tokenizer: eos_id must be an integer >= 0, got {eos_id!r}")
        self.backend, self.add_special_tokens, self.eos_id = backend, add_special_tokens, eos_id
        self._identity: Optional[str] = None

    @property
    def identity(self) -> str:
        """A digest of the whole tokenizer (vocabulary, merges, normalizer, post-processor, as
        `to_str()` serializes them) and of the options: a resume with another tokenizer is
        refused, whatever its name. Worked out once (a large vocabulary takes ~0.1 s)."""
        if self._identity is None:
            text = self.backend.to_str() if hasattr(self.backend, "to_str") else repr(self.backend)
            digest = hashlib.sha256(text.encode()).hexdigest()[:16]
            self._identity = (f"huggingface sha256:{digest} add_special_tokens="
                              f"{self.add_special_tokens} eos_id={self.eos_id}")
        return self._identity

    def encode_texts(self, texts: list[str]) -> list[np.ndarray]:
        # encode_batch_fast (tokenizers >= 0.21) skips the character offsets we do not use
        encode = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
        encodings = encode(texts, add_special_tokens=self.add_special_tokens)
        tail = [] if self.eos_id is None else [self.eos_id]
        return [np.array(e.ids + tail, dtype=np.int64) for e in encodings]


def is_hf_tokenizer(obj: Any) -> bool:
    return hasattr(obj, "encode_batch") and hasattr(obj, "get_vocab_size")


def identity(tokenizer: Optional[TextTokenizer]) -> Optional[str]:
    """What the resumable state records of a tokenizer, so a resume with another one is refused
    (its ids would differ): a Hugging Face tokenizer's digest, a callable's qualified name, or
    a custom tokenizer's `identity` attribute (a string); None where none can be had (a custom
    tokenizer without one: not checked). No tokenizer: UTF-8 bytes."""
    if tokenizer is None:
        return "utf-8 bytes"
    value = getattr(tokenizer, "identity", None)
    return value if isinstance(value, str) else None


def as_tokenizer(obj: Any) -> Optional[TextTokenizer]:
    """What the loader uses for `Loader(tokenizer=obj)`; raises ConfigError for anything else."""
    if obj is None or hasattr(obj, "encode_texts"):
        return obj
    if is_hf_tokenizer(getattr(obj, "backend_tokenizer", obj)):
        return HFTokenizer(obj)
    if callable(obj):
        return PerDocument(obj)
    raise ConfigError(f"tokenizer: must be a callable str -> sequence of ints, a Hugging Face "
                      f"tokenizer, or an object with encode_texts(texts), got {obj!r}")
