"""asynctron: an asyncio-first I/O engine for large-model training.

`await engine.save(state_dict, path)` writes a checkpoint while the loop keeps running;
`await engine.load(path)` reads it back (`await engine.load_into(state_dict, path)`: in place).
"""

from asynctron import comm, datasets, dcp
from asynctron.engine import (
    BackgroundEngine,
    Engine,
    EngineConfig,
    RestoreResult,
    SaveResult,
    SaveTask,
    Tiers,
    free_idle_staging,
    load,
    load_into,
    save,
    staging_statistics,
)
from asynctron.errors import (
    AsynctronError,
    BlendSizeError,
    BusyError,
    CheckpointNotFoundError,
    ClosedError,
    CorruptCheckpointError,
    CorruptDatasetError,
    LoaderWorkerError,
    ObjectNotFoundError,
    PeerError,
    PeerTimeoutError,
    RefusedCredentialsError,
    RefusedObjectError,
    StorageError,
    WouldBlock,
)

__version__ = "0.1.0"

__all__ = [
    "AsynctronError",
    "BackgroundEngine",
    "BlendSizeError",
    "BusyError",
    "CheckpointNotFoundError",
    "ClosedError",
    "CorruptCheckpointError",
    "CorruptDatasetError",
    "Engine",
    "EngineConfig",
    "LoaderWorkerError",
    "ObjectNotFoundError",
    "PeerError",
    "PeerTimeoutError",
    "RefusedCredentialsError",
    "RefusedObjectError",
    "RestoreResult",
    "SaveResult",
    "SaveTask",
    "StorageError",
    "Tiers",
    "WouldBlock",
    "comm",
    "datasets",
    "dcp",
    "free_idle_staging",
    "load",
    "load_into",
    "save",
    "staging_statistics",
]
