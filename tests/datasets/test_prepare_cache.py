"""`asynctron prepare-cache CONFIG`: every index built offline into the config's cache; a run
with the same config then finds them all (no rebuild), and they equal a direct build."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from asynctron import cli
from asynctron.datasets import BlendedDataset, GPTDataset, GPTDatasetConfig, build_gpt_datasets

SIZES = [300, 40, None]


def _fields(prefixes: list[str], cache: str) -> dict[str, Any]:
    """A config as JSON fields: a weighted blend for train, one corpus each for valid and
    test."""
    return {"random_seed": 7, "sequence_length": 32, "eod_id": 0, "pad_id": 1001,
            "blend_per_split": [[prefixes, [1, 3]], [prefixes[:1], None], [prefixes[1:], None]],
            "path_to_cache": cache}


def _config(prefixes: list[str], cache: str, **options: Any) -> GPTDatasetConfig:
    """The same config built in Python, as a run would."""
    return GPTDatasetConfig(random_seed=7, sequence_length=32, eod_id=0, pad_id=1001,
                            blend_per_split=[(prefixes, [1.0, 3.0]), (prefixes[:1], None),
                                             (prefixes[1:], None)],
                            path_to_cache=cache, **options)


def _write(tmp_path: Path, document: Any, name: str = "prepare.json") -> str:
    path = tmp_path / name
    path.write_text(document if isinstance(document, str) else json.dumps(document))
    return str(path)


@pytest.fixture
def prefixes(make_corpus) -> list[str]:
    return [make_corpus(name, seed=k, num_documents=120, eod=0).path_prefix
            for k, name in enumerate("ab")]


def _stats(directory: str) -> dict[str, tuple[int, int]]:
    return {name: (os.stat(os.path.join(directory, name)).st_ino,
                   os.stat(os.path.join(directory, name)).st_mtime_ns)
            for name in os.listdir(directory)}


def _indices(dataset: Any) -> list[np.ndarray]:
    """Every index array of `dataset` and, for a blend, of the datasets under it."""
    if isinstance(dataset, BlendedDataset):
        return [dataset.dataset_index, dataset.dataset_sample_index,
                *(a for d in dataset.datasets for a in _indices(d))]
    assert isinstance(dataset, GPTDataset)
    return [dataset.document_index, dataset.sample_index, dataset.shuffle_index]


def test_prepare_cache_builds_what_a_run_then_loads(prefixes, tmp_path, capsys) -> None:
    cache = str(tmp_path / "cache")
    config_path = _write(tmp_path, {"sizes": SIZES, "config": _fields(prefixes, cache)})
    assert cli.main(["prepare-cache", config_path]) == 0
    lines = capsys.readouterr().out.splitlines()
    # train: 2 GPTDatasets under 1 BlendedDataset; valid and test: one GPTDataset each
    assert len(lines) == 5 + 1
    for line in lines[:-1]:
        assert re.fullmatch(r"(train|valid|test) +(GPTDataset|BlendedDataset) +[\d,]+ samples  "
                            r"built +\d+\.\d\d s", line), line
    assert sorted(line.split()[1] for line in lines[:-1] if line.startswith("train")) == [
        "BlendedDataset", "GPTDataset", "GPTDataset"]
    assert re.fullmatch(rf"5 built, 0 already cached, in \d+\.\d\d s: {re.escape(cache)}",
                        lines[-1])
    blend_line = next(line for line in lines if "BlendedDataset" in line)
    assert int(blend_line.split()[2].replace(",", "")) == SIZES[0]

    prepared = _stats(cache)
    assert len(prepared) == 4 * 4 + 3  # 4 GPTDataset entries (.npy x3 + description), 1 blend
    run = build_gpt_datasets(_config(prefixes, cache), SIZES)
    fast = build_gpt_datasets(_config(prefixes, cache, fast_cache_load=True), SIZES)
    assert _stats(cache) == prepared  # no file rebuilt, none added
    direct = build_gpt_datasets(_config(prefixes, str(tmp_path / "direct")), SIZES)
    for ours, theirs in ((run, direct), (fast, direct)):
        for a, b in zip(ours, theirs, strict=True):
            assert all(np.array_equal(x, y)
                       for x, y in zip(_indices(a), _indices(b), strict=True))

    assert cli.main(["prepare-cache", config_path]) == 0  # again: everything cached
    lines = capsys.readouterr().out.splitlines()
    assert all(" cached " in line for line in lines[:-1]) and len(lines) == 6
    assert lines[-1].startswith("0 built, 5 already cached, in ")
    assert _stats(cache) == prepared


def test_the_runs_own_fast_cache_load_config_serves(prefixes, tmp_path, capsys) -> None:
    cache = str(tmp_path / "cache")
    fields = {**_fields(prefixes, cache), "fast_cache_load": True}
    assert cli.main(["prepare-cache", _write(tmp_path, {"sizes": SIZES, "config": fields})]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("5 built, 0 already cached")


def _bad(fields: dict[str, Any], **changes: Any) -> dict[str, Any]:
    fields = {**fields, **changes}
    return {"sizes": SIZES, "config": {k: v for k, v in fields.items() if v is not ...}}


@pytest.mark.parametrize(("change", "message"), [
    ({"path_to_cache": ...},
     r"config\.path_to_cache: expected the directory to build the cache in, found none"),
    ({"sequence_lenght": 32},
     r"config\.sequence_lenght: expected a GPTDatasetConfig field, found none by that name"),
    ({"tokenizer": "gpt2"},
     r"config\.tokenizer: expected eod_id and pad_id instead \(a tokenizer is not JSON\), "
     r"found a tokenizer"),
    ({"sequence_length": "32"}, r'config\.sequence_length: expected int, found "32"'),
    ({"sequence_length": 1}, r"config\.sequence_length: expected >= 2, found 1"),
    ({"create_attention_mask": 1}, r"config\.create_attention_mask: expected bool, found 1"),
    ({"eod_id": True}, r"config\.eod_id: expected int \| None, found true"),
    ({"blend_per_split": [["a", "b"], None, None]},
     r'config\.blend_per_split\[0\]: expected \[prefixes, weights or null\], found '
     r'\["a", "b"\]'),
    ({"blend_per_split": [None, None]},
     r"config\.blend_per_split: expected 3 blends \(train, valid, test; None to skip one\), "
     r"found 2"),
    ({"random_seed": None}, r"config\.random_seed: expected a value, found null"),
])
def test_a_bad_config_exits_2_naming_the_field(prefixes, tmp_path, capsys, change,
                                               message) -> None:
    cache = str(tmp_path / "cache")
    path = _write(tmp_path, _bad(_fields(prefixes, cache), **change))
    assert cli.main(["prepare-cache", path]) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(rf"asynctron prepare-cache: {re.escape(path)}: {message}\n", err), err
    assert not os.path.exists(cache)


@pytest.mark.parametrize(("document", "message"), [
    ("{not json", r"expected JSON, found an error at line 1 column 2: "),
    ({"sizes": [1, 2], "config": {}}, r"sizes: expected \[train, valid, test\] samples, each "
                                      r"an int >= 0 or null, found \[1, 2\]$"),
    ({"sizes": [1, -1, 0], "config": {}}, r"sizes: expected \[train, valid, test\]"),
    ({"config": {}}, r'expected an object with "sizes" and "config", found keys \["config"\]$'),
    ([], r'expected an object with "sizes" and "config", found \[\]$'),
    ({"sizes": SIZES, "config": []}, r"config: expected an object of GPTDatasetConfig fields, "
                                     r"found \[\]$"),
])
def test_a_bad_file_exits_2_naming_what(tmp_path, capsys, document, message) -> None:
    path = _write(tmp_path, document)
    assert cli.main(["prepare-cache", path]) == 2
    err = capsys.readouterr().err.rstrip("\n")
    assert re.match(rf"asynctron prepare-cache: {re.escape(path)}: {message}", err), err


def test_a_missing_file_or_dataset_exits_2_naming_it(prefixes, tmp_path, capsys) -> None:
    missing = str(tmp_path / "nowhere.json")
    assert cli.main(["prepare-cache", missing]) == 2
    assert capsys.readouterr().err == (f"asynctron prepare-cache: {missing}: expected a "
                                       "readable JSON file, found No such file or directory\n")
    fields = _fields([*prefixes[:1], str(tmp_path / "gone")], str(tmp_path / "cache"))
    assert cli.main(["prepare-cache", _write(tmp_path, {"sizes": SIZES, "config": fields})]) == 2
    assert str(tmp_path / "gone") in capsys.readouterr().err
