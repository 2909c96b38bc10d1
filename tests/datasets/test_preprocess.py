"""Preprocessing JSON lines into .bin/.idx, in-process and with worker processes, and the
`asynctron preprocess` command."""

from __future__ import annotations

import json

import numpy as np
import pytest

from asynctron.cli import main
from asynctron.datasets import IndexedDataset, PreprocessConfig, preprocess

LINES = [{"text": "hello world", "title": "a"},
         {"text": "", "title": "b"},
         {"text": ["first sentence. ", "", "second"], "title": "c"},
         {"text": "ünïcode", "title": "d"}]


@pytest.fixture
def jsonl(tmp_path) -> str:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in LINES) + "\n")
    return str(path)


def test_byte_level_documents_and_eod(jsonl: str, tmp_path) -> None:
    result = preprocess(PreprocessConfig(input=jsonl, output_prefix=str(tmp_path / "out"),
                                         append_eod=True, json_keys=("text", "title")))
    assert result.num_documents == 4
    text = IndexedDataset(result.output_prefixes["text"])
    assert result.output_prefixes["text"] == str(tmp_path / "out_text_document")
    assert text.dtype == np.uint16  # megatron's choice for a 258-token vocabulary
    assert bytes(text[0][:-1].tolist()).decode() == "hello world" and text[0][-1] == 256
    assert text.num_documents == 4
    # the empty document holds no sequence; the list one holds one per non-empty sentence
    assert text.document_indices.tolist() == [0, 1, 1, 3, 4]
    assert bytes(text[1].tolist()) == b"first sentence. "
    assert bytes(text[2][:-1].tolist()) == b"second" and text[2][-1] == 256
    title = IndexedDataset(result.output_prefixes["title"])
    assert [bytes(x[:-1].tolist()) for x in title] == [b"a", b"b", b"c", b"d"]


@pytest.mark.slow
def test_worker_processes_write_the_same_files(jsonl: str, tmp_path) -> None:
    one = preprocess(PreprocessConfig(input=jsonl, output_prefix=str(tmp_path / "one")))
    two = preprocess(PreprocessConfig(input=jsonl, output_prefix=str(tmp_path / "two"),
                                      num_workers=2))
    for suffix in (".bin", ".idx"):
        with open(one.output_prefixes["text"] + suffix, "rb") as a, open(
                two.output_prefixes["text"] + suffix, "rb") as b:
            assert a.read() == b.read()


def test_crlf_lines_give_the_same_files(jsonl: str, tmp_path) -> None:
    crlf = tmp_path / "crlf.jsonl"
    with open(jsonl, "rb") as f:
        crlf.write_bytes(f.read().replace(b"\n", b"\r\n"))
    one = preprocess(PreprocessConfig(input=jsonl, output_prefix=str(tmp_path / "lf")))
    two = preprocess(PreprocessConfig(input=str(crlf), output_prefix=str(tmp_path / "crlf")))
    assert one.num_documents == two.num_documents == 4
    for suffix in (".bin", ".idx"):
        with open(one.output_prefixes["text"] + suffix, "rb") as a, open(
                two.output_prefixes["text"] + suffix, "rb") as b:
            assert a.read() == b.read()


def test_a_bad_line_is_named_and_nothing_is_left(tmp_path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(ValueError, match=rf"^input {path} line 2: expected a JSON object, found "
                                         r"invalid JSON \(.*\); fix or remove the line$"):
        preprocess(PreprocessConfig(input=str(path), output_prefix=str(tmp_path / "o")))
    path.write_text('{"body": "ok"}\n')
    with pytest.raises(ValueError, match=r"line 1: expected key 'text', found \['body'\]; pass "
                                         r"the right --json-keys$"):
        preprocess(PreprocessConfig(input=str(path), output_prefix=str(tmp_path / "o")))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]


def test_cli_preprocess_with_a_tokenizer_json(jsonl: str, tmp_path, tokenizer_json: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    tokenizer = tokenizer_json
    prefix = str(tmp_path / "cli")
    assert main(["preprocess", "--input", jsonl, "--output-prefix", prefix, "--tokenizer",
                 tokenizer, "--append-eod"]) == 0
    out = capsys.readouterr().out
    assert f"text: {prefix}_text_document.bin" in out and "4 documents" in out
    ds = IndexedDataset(f"{prefix}_text_document")
    assert ds[0][-1] == 1  # <|endoftext|>
    assert main(["preprocess", "--input", str(tmp_path / "nope.jsonl"), "--output-prefix",
                 prefix]) == 2
    assert "expected a JSON-lines file, found no such file" in capsys.readouterr().err
