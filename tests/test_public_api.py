"""The public surface, frozen: any change to an `__all__` shows up here, in review."""

from __future__ import annotations

import asynctron
import asynctron.comm
import asynctron.datasets
import asynctron.dcp
import asynctron.engine
import asynctron.errors
import asynctron.storage
import asynctron.testing


def test_top_level() -> None:
    assert set(asynctron.__all__) == {
        "AsynctronError", "BackgroundEngine", "BlendSizeError", "BusyError",
        "CheckpointNotFoundError", "ClosedError", "CorruptCheckpointError",
        "CorruptDatasetError", "Engine", "EngineConfig", "LoaderWorkerError",
        "ObjectNotFoundError", "PeerError", "PeerTimeoutError", "RefusedCredentialsError",
        "RefusedObjectError", "RestoreResult", "SaveResult", "SaveTask", "StorageError", "Tiers",
        "WouldBlock",
        "comm", "datasets", "dcp",
        "free_idle_staging", "load", "load_into", "save", "staging_statistics",
    }


def test_import_asynctron_brings_every_part() -> None:
    import subprocess
    import sys

    code = "import asynctron; print(asynctron.dcp.StorageWriter, asynctron.datasets.AsyncLoader)"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_subpackages() -> None:
    assert set(asynctron.engine.__all__) == {
        "BackgroundEngine", "BudgetStatistics", "ByteBudget", "Engine", "EngineConfig",
        "Milestone", "RestoreResult", "SaveResult", "SaveTask", "SlabCacheStatistics", "Tiers",
        "free_idle_staging", "load", "load_into", "save", "staging_statistics",
    }
    assert set(asynctron.storage.__all__) == {
        "Backend", "Committed", "FileWriter", "ItemRecord", "LocalBackend", "Manifest",
        "Retention", "SaveArea", "StoreStatistics", "backend_for", "register_backend",
        "split_by_size_and_type",
        "store_operation",
    }
    assert set(asynctron.comm.__all__) == {
        "AllReduceTask", "Bucket", "BucketConfig", "BucketManager", "CollectiveGroup",
        "AsyncDataParallel", "PeerChannel", "StepTimings", "new_gloo_group", "wait_future",
        "wait_work",
    }
    assert set(asynctron.errors.__all__) == {
        "AsynctronError", "BlendSizeError", "BusyError", "CheckpointNotFoundError", "ClosedError",
        "CorruptCheckpointError", "CorruptDatasetError", "LoaderWorkerError",
        "ObjectNotFoundError", "PeerError", "PeerTimeoutError", "RefusedCredentialsError",
        "RefusedObjectError", "StorageError", "WouldBlock",
    }
    assert set(asynctron.datasets.__all__) == {
        "AsyncLoader", "BlendedDataset", "BlendedMegatronDatasetBuilder",
        "ByteTokenizer", "DatasetIndex", "GPTDataset", "GPTDatasetConfig", "HFTokenizer",
        "IndexedDataset", "IndexedDatasetBuilder", "MockGPTDataset", "MockGPTLowLevelDataset",
        "ObjectCacheUsage", "ObjectStorageConfig", "PreparedDataset", "PreprocessConfig",
        "PreprocessResult", "Split", "build_blending_indices", "build_document_index",
        "build_exhaustive_blending_indices", "build_gpt_datasets", "build_sample_index",
        "build_shuffle_index", "collate", "load_tokenizer", "object_cache_usage", "optimal_dtype",
        "prepare_cache", "preprocess", "write_indexed_dataset",
    }
    assert set(asynctron.testing.__all__) == {"FaultyBackend", "Gate", "GatedObjectClient",
                                              "LoopWatchdog", "LoopWatchdogReport",
                                              "ShapingProxy", "ShapingStatistics",
                                              "StoreProfile"}
    assert set(asynctron.dcp.__all__) == {"AsyncStager", "StorageReader", "StorageWriter"}


def test_dcp_plugins_are_dcps_own_types() -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import AsyncStager

    assert issubclass(asynctron.dcp.StorageWriter, dcp.StorageWriter)
    assert issubclass(asynctron.dcp.StorageReader, dcp.StorageReader)
    # AsyncStager is a Protocol with data members, which issubclass refuses: its MRO tells
    assert AsyncStager in asynctron.dcp.AsyncStager.__mro__
    assert AsyncStager in asynctron.dcp.StorageWriter.__mro__


def test_every_error_is_in_errors_and_at_the_top_level() -> None:
    """One home for errors: every exception class a public module exports is defined in
    asynctron.errors, and asynctron exports all of them."""
    modules = (asynctron, asynctron.comm, asynctron.datasets, asynctron.dcp, asynctron.engine,
               asynctron.storage, asynctron.testing)
    for module in modules:
        for name in module.__all__:
            value = getattr(module, name)
            if isinstance(value, type) and issubclass(value, BaseException):
                assert value.__module__ == "asynctron.errors", f"{module.__name__}.{name}"
    assert set(asynctron.errors.__all__) <= set(asynctron.__all__)
    for name in asynctron.errors.__all__:
        assert getattr(asynctron, name) is getattr(asynctron.errors, name)


def test_every_exported_name_exists() -> None:
    for module in (asynctron, asynctron.comm, asynctron.datasets, asynctron.dcp,
                   asynctron.engine, asynctron.errors, asynctron.storage, asynctron.testing):
        for name in module.__all__:
            assert hasattr(module, name), f"{module.__name__}.{name}"


def test_storage_and_comm_never_import_the_engine() -> None:
    """Data flows one way: engine → storage, comm; nothing in storage or comm imports engine."""
    import pathlib
    import re

    imports_engine = re.compile(r"^\s*(from|import)\s+asynctron\.engine\b", re.MULTILINE)
    for package in (asynctron.storage, asynctron.comm):
        for source in pathlib.Path(package.__file__).parent.rglob("*.py"):
            assert not imports_engine.search(source.read_text()), source


def test_nothing_below_the_dcp_plugins_imports_them() -> None:
    """asynctron.dcp sits on top of engine and storage, beside datasets; only the benchmarks
    use it."""
    import pathlib

    root = pathlib.Path(asynctron.__file__).parent
    for source in root.rglob("*.py"):
        if {"dcp", "bench"} & set(source.parts):
            continue
        assert "asynctron.dcp" not in source.read_text(), source


def test_nothing_below_datasets_imports_it() -> None:
    """datasets sits on top (it uses engine's loop helpers); engine, storage, comm and the
    shared modules never import datasets. Only the applications do: the CLI, the demo and the
    benchmarks."""
    import pathlib

    root = pathlib.Path(asynctron.__file__).parent
    for source in root.rglob("*.py"):
        if {"datasets", "_demo", "bench"} & set(source.parts) or source.name == "cli.py":
            continue
        assert "asynctron.datasets" not in source.read_text(), source


def _sources(*packages: str) -> list[tuple[str, str]]:
    import pathlib

    root = pathlib.Path(asynctron.__file__).parent
    return [(str(source), source.read_text()) for package in packages
            for source in sorted((root / package).rglob("*.py"))]


def test_the_dcp_plugins_build_on_seams_not_internals() -> None:
    """asynctron.dcp reaches the engine and storage only through their packages' seams: no
    private module of theirs, no underscore name, no subclass of an engine class."""
    import ast

    for path, text in _sources("dcp"):
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(
                    ("asynctron.engine", "asynctron.storage")):
                assert not any(part.startswith("_") for part in node.module.split(".")), path
                assert not any(alias.name.startswith("_") for alias in node.names), path
            if isinstance(node, ast.ClassDef):
                assert "Engine" not in [getattr(base, "id", getattr(base, "attr", None))
                                        for base in node.bases], (path, node.name)


def test_only_the_storage_backends_touch_files() -> None:
    """The engine and the DCP plugins make no filesystem call of their own: every byte they
    read or write goes through a storage backend (`asynctron.storage.backends`)."""
    import re

    file_call = re.compile(r"\bos\.(open|pwritev?|preadv?|fsync|rename|replace|stat|lstat|"
                           r"fstat|makedirs|mkdir|remove|unlink|listdir|scandir|ftruncate|"
                           r"path)\b|\bmmap\.mmap\(|(?<![\w.])open\(|\bshutil\.")
    for path, text in _sources("engine", "dcp"):
        code = re.sub(r'"""[\s\S]*?"""', "", text)  # docstrings may name the calls
        assert not file_call.search(code), (path, file_call.search(code))
    names = re.compile(r"\bos\.path\.(join|dirname|basename)\b")  # names, not calls
    for path, text in _sources("datasets/object_cache"):  # its files are local/_cache_files'
        code = names.sub("", re.sub(r'"""[\s\S]*?"""', "", text))
        found = file_call.search(code) or re.search(r"\b(fcntl|ctypes)\b", code)
        assert not found, (path, found)


def test_the_faces_asynctrons_parts_build_on() -> None:
    """Each face's `__all__`, frozen: what the other packages of asynctron may import."""
    import importlib

    faces = {
        "asynctron.storage.format": {
            "ALGORITHMS", "ALIGN_BYTES", "Batches", "BinLayout", "BodySegments", "Checksums",
            "ChunkIndex", "FlatStateDict", "ItemHasher", "ItemKind", "ItemRecord",
            "MANIFEST_NAME", "MAX_GAP_BYTES", "MAX_MANIFEST_BYTES", "MAX_METADATA_BYTES",
            "METADATA_NAME", "Manifest", "MetadataUnpickler", "NUMPY_DTYPES", "Overlap",
            "PLAIN_TENSORS", "Part", "PlainPlan", "PlannedItem", "ReadBatch", "ReadJob",
            "SMALL_ALIGN_BYTES", "SavePlan", "ShardInfo", "Structure", "TORCH_DTYPES", "XXH3_64",
            "align_up", "bin_file_name", "check_digest", "check_files", "check_no_overlap",
            "check_object_blob", "chunk_large_items", "dcp_structure", "decode_blob", "digest",
            "dtype_name", "encode_manifest", "flatten", "is_plain", "item_paths", "layout_bin",
            "merge_structures", "metadata_bytes", "metadata_of", "parse_dcp_manifest",
            "parse_manifest", "paused_gc", "plan_final", "plan_global", "plan_local",
            "plan_plain_global", "plan_reads", "saved_value", "split_by_size_and_type",
            "tensor_of", "torch_save_frame", "unflatten", "value_paths",
        },
        "asynctron.storage.backends": {
            "Backend", "CheckpointLease", "CheckpointReader", "CheckpointStorage", "Committed",
            "CommittedCheckpoints", "Committer", "FileStorage", "FileWriter", "ItemReader",
            "LocalBackend", "MappableFiles", "MappedItems", "NewFile", "RangedFile",
            "RangedFiles", "ReadableFile", "Retention", "SaveArea", "SaveStorage",
            "StoreOperation", "StoreStatistics", "WriteBatch", "backend_for",
            "commit_checkpoint", "register_backend", "served_scheme", "serves_ranged_files",
            "store_operation", "whole_file",
        },
        "asynctron.storage.node_files": {
            "BlockFile", "DirLock", "FileIO", "LocalFileIO", "LocalFiles", "SharedCounters",
            "SharedLock", "file_size", "holding", "map_shared", "publish_filled", "read_head",
            "replace_empty",
        },
        "asynctron.storage.backends.local": {"BinWriter", "LocalBackend", "LocalCheckpoints",
                                             "read_manifest"},
        "asynctron.storage.backends.objects": {
            "Listing", "ObjectClient", "ObjectInfo", "ObjectReads", "ObjectStoreBackend",
            "ObjectUrl", "ObjectWrites", "OpenUpload", "PartLimits", "PartUploads",
            "PreconditionFailedError", "StoreConfig",
        },
        "asynctron.engine.tiers": {"RestoreResult", "Tiers", "parse_shard"},
        "asynctron.engine.lowlevel": {
            "SLAB_CACHE", "SaveRequest", "SaveResources", "Slab", "SlabFill", "SlabFiller",
            "build_request", "dcp_items", "file_plan", "launch_copies", "mark_ready",
            "stage_and_write",
        },
    }
    for module, names in faces.items():
        assert set(importlib.import_module(module).__all__) == names, module


def _cross_package_imports() -> list[tuple[str, str, str]]:
    """(importing file, module, name) of every `from asynctron.X... import name` in asynctron
    whose X is another package than the importing file's (a top-level module, such as the
    CLI, is a package of its own; the top-level private modules (`_concurrency`, `_memory`,
    ...) are the root package's, which every package is part of)."""
    import ast
    import pathlib

    root = pathlib.Path(asynctron.__file__).parent

    def package_of(parts: list[str]) -> str | None:
        return parts[0] if (root / parts[0]).is_dir() else None

    found = []
    for source in sorted(root.rglob("*.py")):
        parts = list(source.relative_to(root).with_suffix("").parts)
        own = package_of(parts) or parts[0]
        for node in ast.walk(ast.parse(source.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                    and node.module.startswith("asynctron.")):
                continue
            target = node.module.split(".")[1:]
            package = package_of(target)
            if package is None or package == own:
                continue
            found.extend((str(source.relative_to(root)), node.module, alias.name)
                         for alias in node.names)
    return found


def test_packages_import_each_other_only_through_their_faces() -> None:
    """Across packages, an import names a face (a module with no `_private` part below its
    package) and only names in that face's `__all__`: no private module, no name a face does
    not promise."""
    import importlib

    wrong = []
    for source, module, name in _cross_package_imports():
        if any(part.startswith("_") for part in module.split(".")[2:]):
            wrong.append(f"{source}: {module} is private")
        elif name not in getattr(importlib.import_module(module), "__all__", ()):
            wrong.append(f"{source}: {module}.{name} is not in its __all__")
    assert wrong == []
