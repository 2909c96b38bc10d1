"""torch.distributed.checkpoint (DCP) storage plugins on asynctron's pipeline: stock
`dcp.save`, `dcp.async_save` and `dcp.load` keep their planners (DTensor, resharding) and their
calls, and asynctron stages, writes, checksums, commits and reads.

    dcp.save(sd, storage_writer=asynctron.dcp.StorageWriter(path))
    dcp.async_save(sd, storage_writer=asynctron.dcp.StorageWriter(path))  # stages too
    dcp.load(sd, storage_reader=asynctron.dcp.StorageReader(path))
"""

from asynctron.dcp._reader import StorageReader
from asynctron.dcp._stager import AsyncStager
from asynctron.dcp._writer import StorageWriter

__all__ = ["AsyncStager", "StorageReader", "StorageWriter"]
