"""`asynctron prepare-cache CONFIG`: every dataset's cached indices built offline, as megatron's
`tools/prepare_cache.py` does, so that no rank builds, or waits on a build, at start-up (a run
then loads them with `fast_cache_load`).

CONFIG is a JSON file `{"sizes": [train, valid, test], "config": {...}}`: the samples of each
split (an int, or null as `build_gpt_datasets` takes it) and `GPTDatasetConfig` fields by name.
A tokenizer is not JSON: `eod_id` and `pad_id` stand for it. `blend` is `[prefixes, weights or
null]`, `blend_per_split` a list of three of those (or nulls), `sequences_per_dataset` an object
of prefix -> [sequences, documents]. `path_to_cache` is required. `fast_cache_load` and
`defer_npy_index_mmap` may be set, so that the run's own file serves; they are off while the
cache is prepared.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from asynctron.datasets.formats._blend_builder import build_gpt_datasets
from asynctron.datasets.formats._cache import CacheUse, observing
from asynctron.datasets.formats._config import GPTDatasetConfig
from asynctron.storage.backends import backend_for

#: The array whose length is a cached dataset's number of samples, by array name: a GPT
#: dataset's shuffle index, a blend's dataset index.
SAMPLE_COUNT_ARRAYS = ("shuffle_index", "dataset_index")

#: Fields a run reads its cache with; preparing builds the cache, so they are off.
_LOAD_ONLY_FIELDS = ("fast_cache_load", "defer_npy_index_mmap")

_SCALARS: dict[str, tuple[type, ...]] = {"bool": (bool,), "int": (int,), "float": (int, float),
                                         "str": (str,)}


class PrepareCacheConfigError(ValueError):
    """The CONFIG file is unreadable, or a field or value in it is not allowed; the message
    names the file and the field."""


@dataclass(frozen=True, slots=True)
class PreparedDataset:
    """One dataset's cached indices: its split and class, its samples, whether they were built
    now (else they were cached already) and the seconds that took."""

    split: str
    class_name: str
    num_samples: int
    built: bool
    seconds: float


@dataclass(frozen=True, slots=True)
class PrepareCacheReport:
    """What `prepare_cache` did: every dataset, in the order they were done, and the total."""

    path_to_cache: str
    datasets: list[PreparedDataset]
    elapsed_s: float


def prepare_cache(config_path: str,
                  on_dataset: Callable[[PreparedDataset], None] | None = None
                  ) -> PrepareCacheReport:
    """Build every index the CONFIG file at `config_path` describes into its `path_to_cache`
    (those already cached are loaded, not rebuilt), calling `on_dataset` as each is done (from
    the builder's threads, one call at a time).

    Raises:
        PrepareCacheConfigError: the file is unreadable or has a bad field or value.
        FileNotFoundError, ValueError, CorruptDatasetError: from the build (a missing or bad
            dataset file, a blend the data cannot fill).
    """
    config, sizes = read_prepare_config(config_path)
    assert config.path_to_cache is not None  # read_prepare_config requires it
    datasets: list[PreparedDataset] = []
    lock = threading.Lock()

    def done(use: CacheUse) -> None:
        count = next(use.lengths[name] for name in SAMPLE_COUNT_ARRAYS if name in use.lengths)
        dataset = PreparedDataset(use.entry.split, use.entry.class_name, count, use.built,
                                  use.seconds)
        with lock:
            datasets.append(dataset)
            if on_dataset is not None:
                on_dataset(dataset)

    start = time.perf_counter()
    with observing(done):
        build_gpt_datasets(config, sizes)
    return PrepareCacheReport(config.path_to_cache, datasets, time.perf_counter() - start)


def read_prepare_config(path: str) -> tuple[GPTDatasetConfig, list[int | None]]:
    """The config and sizes of the CONFIG file at `path` (see the module docstring), with
    `fast_cache_load` and `defer_npy_index_mmap` off.

    Raises:
        PrepareCacheConfigError: naming `path` and the field or value at fault.
        ValueError: `path` is a URL no storage backend serves.
    """
    try:
        with backend_for(path).open_file(path) as f:
            document = json.loads(f.pread(f.nbytes, 0))
    except OSError as exc:
        raise PrepareCacheConfigError(f"{path}: expected a readable JSON file, found "
                                      f"{exc.strerror or exc}") from exc
    except json.JSONDecodeError as exc:
        raise PrepareCacheConfigError(f"{path}: expected JSON, found an error at line "
                                      f"{exc.lineno} column {exc.colno}: {exc.msg}") from exc
    if not isinstance(document, dict) or set(document) != {"sizes", "config"}:
        found = (f"keys {json.dumps(sorted(document))}" if isinstance(document, dict)
                 else json.dumps(document))
        raise PrepareCacheConfigError(f'{path}: expected an object with "sizes" and "config", '
                                      f"found {found}")
    sizes = _sizes(path, document["sizes"])
    fields = document["config"]
    if not isinstance(fields, dict):
        raise PrepareCacheConfigError(f"{path}: config: expected an object of GPTDatasetConfig "
                                      f"fields, found {json.dumps(fields)}")
    if fields.get("path_to_cache") is None:
        raise PrepareCacheConfigError(f"{path}: config.path_to_cache: expected the directory to "
                                      "build the cache in, found none")
    annotations = {f.name: str(f.type) for f in dataclasses.fields(GPTDatasetConfig)}
    values = {name: _value(path, name, value, annotations) for name, value in fields.items()}
    values.update(dict.fromkeys(_LOAD_ONLY_FIELDS, False))
    try:
        return GPTDatasetConfig(**values), sizes
    except (TypeError, ValueError) as exc:
        raise PrepareCacheConfigError(f"{path}: config.{exc}") from exc


def _sizes(path: str, sizes: Any) -> list[int | None]:
    if not (isinstance(sizes, list) and len(sizes) == 3 and all(
            s is None or (isinstance(s, int) and not isinstance(s, bool) and s >= 0)
            for s in sizes)):
        raise PrepareCacheConfigError(f"{path}: sizes: expected [train, valid, test] samples, "
                                      f"each an int >= 0 or null, found {json.dumps(sizes)}")
    return sizes


def _value(path: str, name: str, value: Any, annotations: dict[str, str]) -> Any:
    """`value` of field `name` as GPTDatasetConfig takes it, checked against its type."""
    if name not in annotations:
        raise PrepareCacheConfigError(f"{path}: config.{name}: expected a GPTDatasetConfig "
                                      f"field, found none by that name")
    if name == "tokenizer":
        raise PrepareCacheConfigError(f"{path}: config.tokenizer: expected eod_id and pad_id "
                                      "instead (a tokenizer is not JSON), found a tokenizer")
    annotation = annotations[name]
    optional = annotation.endswith(" | None")
    if value is None:
        if optional:
            return None
        raise PrepareCacheConfigError(f"{path}: config.{name}: expected a value, found null")
    if name == "blend":
        return _blend(path, name, value)
    if name == "blend_per_split":
        if not isinstance(value, list):
            raise PrepareCacheConfigError(f"{path}: config.blend_per_split: expected a list of "
                                          f"three blends (or nulls), found {json.dumps(value)}")
        return [None if blend is None else _blend(path, f"blend_per_split[{i}]", blend)
                for i, blend in enumerate(value)]
    if name == "sequences_per_dataset":
        if not (isinstance(value, dict) and all(
                isinstance(v, list) and len(v) == 2 and all(_is_int(n) for n in v)
                for v in value.values())):
            raise PrepareCacheConfigError(
                f"{path}: config.sequences_per_dataset: expected an object of prefix -> "
                f"[sequences, documents], found {json.dumps(value)}")
        return value
    kinds = _SCALARS.get(annotation.removesuffix(" | None"))
    if kinds is None:
        raise PrepareCacheConfigError(f"{path}: config.{name}: expected a field settable from "
                                      f"JSON, found one of type {annotation}")
    if not isinstance(value, kinds) or (bool not in kinds and isinstance(value, bool)):
        raise PrepareCacheConfigError(f"{path}: config.{name}: expected {annotation}, found "
                                      f"{json.dumps(value)}")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _blend(path: str, name: str, value: Any) -> tuple[list[str], list[float] | None]:
    """A JSON blend `[prefixes, weights or null]` as GPTDatasetConfig takes it."""
    if (isinstance(value, list) and len(value) == 2 and isinstance(value[0], list)
            and all(isinstance(p, str) for p in value[0])
            and (value[1] is None or (isinstance(value[1], list) and all(
                isinstance(w, int | float) and not isinstance(w, bool) for w in value[1])))):
        return list(value[0]), None if value[1] is None else [float(w) for w in value[1]]
    raise PrepareCacheConfigError(f"{path}: config.{name}: expected [prefixes, weights or null],"
                                  f" found {json.dumps(value)}")
