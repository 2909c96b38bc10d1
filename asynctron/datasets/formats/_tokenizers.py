"""Tokenizers for preprocessing: a byte-level one that needs nothing, and a local HuggingFace
`tokenizer.json`. Both have megatron's `eod`, `pad` and `vocab_size`."""

from __future__ import annotations

import os
from typing import Any, Protocol


class TextTokenizer(Protocol):
    """What preprocessing needs: text to ids, the end-of-document id and the vocabulary size."""

    @property
    def eod(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    def tokenize(self, text: str) -> list[int]: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0-255; end-of-document 256, pad 257 (vocabulary 258)."""

    eod = 256
    pad = 257
    vocab_size = 258

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Any) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")

    @property
    def unique_identifiers(self) -> dict[str, Any]:
        return {"class": type(self).__name__}


#: end-of-document tokens tried, in order, when none is named
EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")


class HFTokenizer:
    """A HuggingFace `tokenizer.json` on local disk (the `tokenizers` package; nothing is
    downloaded).

    Args:
        path: the `tokenizer.json` file.
        eod_token: the end-of-document token; None: the first of `EOD_CANDIDATES` present.
        pad_token: the pad token, if any.
    """

    def __init__(self, path: str, *, eod_token: str | None = None,
                 pad_token: str | None = None) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise ImportError("tokenizer.json: expected the `tokenizers` package, found it "
                              "missing; pip install tokenizers (or use the byte tokenizer)"
                              ) from exc
        if not os.path.isfile(path):
            raise FileNotFoundError(f"tokenizer {path}: expected a tokenizer.json file, found "
                                    "none; give a local path (nothing is downloaded)")
        self.path = path
        self._tokenizer = Tokenizer.from_file(path)
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.eod = self._token_id(eod_token, EOD_CANDIDATES, "eod_token")
        self.pad = (self._token_id(pad_token, (), "pad_token") if pad_token is not None
                    else None)

    def _token_id(self, name: str | None, candidates: tuple[str, ...], field: str) -> int:
        for token in (name,) if name is not None else candidates:
            token_id = self._tokenizer.token_to_id(token)
            if token_id is not None:
                return int(token_id)
        wanted = repr(name) if name is not None else f"one of {list(candidates)}"
        raise ValueError(f"tokenizer {self.path} {field}: expected {wanted} in the vocabulary, "
                         f"found none; name the token with --{field.replace('_', '-')}")

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids: Any) -> str:
        return self._tokenizer.decode([int(i) for i in ids])

    @property
    def unique_identifiers(self) -> dict[str, Any]:
        return {"class": type(self).__name__, "path": self.path, "eod": self.eod}


def load_tokenizer(spec: str, *, eod_token: str | None = None) -> TextTokenizer:
    """`"byte"` for `ByteTokenizer`, else the path of a local `tokenizer.json`."""
    if spec == "byte":
        return ByteTokenizer()
    return HFTokenizer(spec, eod_token=eod_token)
