"""Preprocessing: JSON lines to megatron `.bin`/`.idx` files, like megatron's
`tools/preprocess_data.py` (without sentence splitting).

Each line is a JSON object; for each `json_keys` key its text (or list of sentences) is
tokenized, sentence by sentence (empty ones dropped), optionally followed by the
end-of-document id, and written as one document to `<output_prefix>_<key>_document.{bin,idx}`.
Tokenizing runs in `num_workers` processes (lines handed out in order, in chunks); writing runs
in the calling process, in input order. The input is read, and the outputs written, through the
storage backend of their paths (`backend_for`).
"""

from __future__ import annotations

import io
import json
import multiprocessing
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from asynctron.datasets.formats._builder import IndexedDatasetBuilder
from asynctron.datasets.formats._indexed import bin_path, idx_path, optimal_dtype
from asynctron.datasets.formats._tokenizers import TextTokenizer, load_tokenizer
from asynctron.storage.backends import backend_for

if TYPE_CHECKING:
    from asynctron.storage.backends import ReadableFile

_CHUNK_LINES = 32
#: bytes of the input read per call
_READ_BYTES = 1 << 20


@dataclass(frozen=True, kw_only=True, slots=True)
class PreprocessConfig:
    """What to preprocess and how."""

    input: str
    """The JSON-lines file."""
    output_prefix: str
    """Outputs are `<output_prefix>_<key>_document.bin/.idx`."""
    tokenizer: str = "byte"
    """`byte`, or the path of a local HuggingFace `tokenizer.json`."""
    eod_token: str | None = None
    """The end-of-document token of a `tokenizer.json` (default: a usual one it has)."""
    json_keys: Sequence[str] = ("text",)
    """The keys whose text is tokenized, each to its own dataset."""
    append_eod: bool = False
    """End every non-empty document with the end-of-document id."""
    num_workers: int = 1
    """Tokenizing processes (1: tokenize in this process)."""

    def __post_init__(self) -> None:
        if not isinstance(self.num_workers, int) or self.num_workers < 1:
            raise ValueError(f"num_workers: expected an int >= 1, found {self.num_workers!r}")
        if not self.json_keys:
            raise ValueError("json_keys: expected at least one key, found none")
        try:
            backend_for(self.input).open_file(self.input).close()
        except (FileNotFoundError, IsADirectoryError) as exc:
            raise FileNotFoundError(f"input {self.input}: expected a JSON-lines file, found no "
                                    "such file") from exc


@dataclass(frozen=True, slots=True)
class PreprocessResult:
    """What `preprocess` wrote."""

    output_prefixes: dict[str, str]
    num_documents: int
    num_tokens: int
    elapsed_s: float


class _Encoder:
    """Tokenizes one line; one per worker process (the tokenizer is built there)."""

    tokenizer: TextTokenizer | None = None

    def __init__(self, config: PreprocessConfig) -> None:
        self.config = config

    def start(self) -> None:
        _Encoder.tokenizer = load_tokenizer(self.config.tokenizer,
                                            eod_token=self.config.eod_token)

    def encode(self, numbered: tuple[int, str]) -> tuple[int, dict[str, tuple[list[int],
                                                                               list[int]]]]:
        number, line = numbered
        tokenizer = _Encoder.tokenizer
        assert tokenizer is not None
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"input {self.config.input} line {number}: expected a JSON object, "
                             f"found invalid JSON ({exc.msg}); fix or remove the line") from None
        out = {}
        for key in self.config.json_keys:
            if not isinstance(data, dict) or key not in data:
                raise ValueError(f"input {self.config.input} line {number}: expected key "
                                 f"{key!r}, found {sorted(data) if isinstance(data, dict) else type(data).__name__}; "  # noqa: E501
                                 "pass the right --json-keys")
            text = data[key]
            sentences = text if isinstance(text, list) else [text]
            ids: list[int] = []
            lengths: list[int] = []
            for sentence in sentences:
                sentence_ids = tokenizer.tokenize(sentence)
                if sentence_ids:
                    ids.extend(sentence_ids)
                    lengths.append(len(sentence_ids))
            if ids and self.config.append_eod:
                ids.append(tokenizer.eod)
                lengths[-1] += 1
            out[key] = (ids, lengths)
        return len(line), out


def _numbered_lines(path: str) -> Iterator[tuple[int, str]]:
    """The non-blank lines of the UTF-8 file `path` (universal newlines), numbered from 1."""
    with backend_for(path).open_file(path) as file, io.TextIOWrapper(
            io.BufferedReader(_Stream(file), _READ_BYTES), encoding="utf-8") as text:
        for number, line in enumerate(text, start=1):
            if line.strip():
                yield number, line


class _Stream(io.RawIOBase):
    """A backend's open file read from start to end, as `io.BufferedReader` reads a file."""

    def __init__(self, file: ReadableFile) -> None:
        self._file = file
        self._position = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self._file.pread(len(buffer), self._position)
        buffer[:len(data)] = data
        self._position += len(data)
        return len(data)


def output_prefix(config: PreprocessConfig, key: str) -> str:
    """Megatron's output naming: `<prefix>_<key>_document`."""
    return f"{config.output_prefix}_{key}_document"


def preprocess(config: PreprocessConfig) -> PreprocessResult:
    """Tokenize `config.input` into one `.bin`/`.idx` pair per JSON key.

    Raises:
        FileNotFoundError: the input or the tokenizer file is missing.
        ValueError: a line is not JSON or lacks a key (naming the file and line); nothing is
            left behind.

    Memory: the index is spilled to disk as it grows (see `IndexedDatasetBuilder`); the workers
    hold a few chunks of lines.
    """
    started = time.perf_counter()
    encoder = _Encoder(config)
    encoder.start()
    assert encoder.tokenizer is not None
    dtype = optimal_dtype(encoder.tokenizer.vocab_size)
    prefixes = {key: output_prefix(config, key) for key in config.json_keys}
    builders = {key: IndexedDatasetBuilder(bin_path(prefix), dtype=dtype)
                for key, prefix in prefixes.items()}  # each makes the directories it needs
    num_documents = num_tokens = 0
    pool: Any = None
    try:
        lines = _numbered_lines(config.input)
        if config.num_workers > 1:
            pool = multiprocessing.get_context("spawn").Pool(config.num_workers,
                                                             initializer=encoder.start)
            encoded = pool.imap(encoder.encode, lines, _CHUNK_LINES)
        else:
            encoded = map(encoder.encode, lines)
        for _, document in encoded:
            num_documents += 1
            for key, (ids, lengths) in document.items():
                builders[key].add_document(ids, lengths)
                num_tokens += len(ids)
        for key, builder in builders.items():
            builder.finalize(idx_path(prefixes[key]))
    except BaseException:
        for key, builder in builders.items():
            builder.abort()
            backend_for(idx_path(prefixes[key])).remove_file(idx_path(prefixes[key]))
        raise
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    return PreprocessResult(prefixes, num_documents, num_tokens,
                            time.perf_counter() - started)
