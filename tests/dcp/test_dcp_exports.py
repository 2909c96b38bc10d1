"""The public surface of `asynctron.dcp`, frozen (as tests/test_public_api.py freezes the
other subpackages'), and where it sits: nothing below it imports it."""

from __future__ import annotations

import pathlib

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import AsyncStager as DcpAsyncStager

import asynctron
import asynctron.dcp


def test_exports() -> None:
    assert set(asynctron.dcp.__all__) == {"AsyncStager", "StorageReader", "StorageWriter"}
    assert issubclass(asynctron.dcp.StorageWriter, dcp.StorageWriter)
    assert issubclass(asynctron.dcp.StorageReader, dcp.StorageReader)
    assert DcpAsyncStager in asynctron.dcp.AsyncStager.__mro__
    assert DcpAsyncStager in asynctron.dcp.StorageWriter.__mro__


def test_engine_storage_and_comm_never_import_dcp() -> None:
    root = pathlib.Path(asynctron.__file__).parent
    for package in ("engine", "storage", "comm", "datasets"):
        for source in (root / package).rglob("*.py"):
            assert "asynctron.dcp" not in source.read_text(), source
