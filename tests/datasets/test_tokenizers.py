"""Tokenizers: the byte tokenizer, and a local HuggingFace tokenizer.json made here."""

from __future__ import annotations

import pytest

from asynctron.datasets import ByteTokenizer, HFTokenizer, load_tokenizer


def test_byte_tokenizer_round_trips_utf8() -> None:
    tokenizer = load_tokenizer("byte")
    assert isinstance(tokenizer, ByteTokenizer)
    ids = tokenizer.tokenize("héllo")
    assert ids == list("héllo".encode()) and max(ids) < 256
    assert tokenizer.detokenize([*ids, tokenizer.eod]) == "héllo"
    assert (tokenizer.eod, tokenizer.pad, tokenizer.vocab_size) == (256, 257, 258)


def test_hf_tokenizer_json(tokenizer_json: str) -> None:
    path = tokenizer_json
    tokenizer = load_tokenizer(path)
    assert isinstance(tokenizer, HFTokenizer)
    assert tokenizer.eod == 1 and tokenizer.vocab_size == 11  # 3 special + 8 words
    ids = tokenizer.tokenize("the cat ran")
    assert len(ids) == 3 and tokenizer.detokenize(ids) == "the cat ran"
    assert HFTokenizer(path, eod_token="[PAD]").eod == 2


def test_hf_tokenizer_errors(tokenizer_json: str, tmp_path) -> None:
    path = tokenizer_json
    with pytest.raises(ValueError, match=r"eod_token: expected '<eos>' in the vocabulary, found "
                                         r"none; name the token with --eod-token$"):
        HFTokenizer(path, eod_token="<eos>")
    with pytest.raises(FileNotFoundError, match=r"expected a tokenizer\.json file, found none; "
                                                r"give a local path"):
        load_tokenizer(str(tmp_path / "missing.json"))
