"""Storage, in two faces and one home:

- `asynctron.storage.format`: what a checkpoint *is* (the plan, each bin's layout, the
  manifest and its checksums, DCP's format), with no I/O;
- `asynctron.storage.backends`: where bytes *live* (the `Backend` seam, `backend_for`, the
  commit protocol), one backend per folder;
- `asynctron.storage.node_files`: the files of this node (locks, maps, atomic publishes) that
  the local backend and the datasets' node-local cache share.

Never imports the engine; blocking calls run through the `RunBlocking` door
(`asynctron._concurrency`) that the engine passes in. `__all__` here is what a user reaches
for; each face's own `__all__` is what asynctron's other parts build on (both frozen by
`tests/test_public_api.py`).
"""

from asynctron.storage.backends import (
    Backend,
    Committed,
    FileWriter,
    LocalBackend,
    Retention,
    SaveArea,
    StoreStatistics,
    backend_for,
    register_backend,
    store_operation,
)
from asynctron.storage.format import ItemRecord, Manifest, split_by_size_and_type

__all__ = [
    "Backend",
    "Committed",
    "FileWriter",
    "ItemRecord",
    "LocalBackend",
    "Manifest",
    "Retention",
    "SaveArea",
    "StoreStatistics",
    "backend_for",
    "register_backend",
    "split_by_size_and_type",
    "store_operation",
]
