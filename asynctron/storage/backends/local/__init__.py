"""The local (POSIX) filesystem backend: checkpoints as directories published by rename,
over the node's files (`asynctron.storage.node_files`)."""

from asynctron.storage.backends.local._backend import LocalBackend, LocalCheckpoints
from asynctron.storage.backends.local._reader import read_manifest
from asynctron.storage.backends.local._writer import BinWriter

__all__ = ["BinWriter", "LocalBackend", "LocalCheckpoints", "read_manifest"]
