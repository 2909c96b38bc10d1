"""One rank's `write_data`: DCP's final plan written by asynctron's pipeline.

Stages (on the runtime's loop; every step that touches bytes runs on the engine's executor):
1. request: DCP's write items become planned items (`dcp_items`: tensors resolved through the
   planner, DTensor shards too; pickled values through `planner.resolve_data`), cut into dim-0
   chunks where a tensor is larger than its share of the bins, split onto bins, laid out in
   DCP's format (each tensor inside its `torch.save` frame) and cut into slab-sized batches
   (`file_plan`, `build_request`): the same plan `Engine.save(format="dcp")` makes;
2. stage+write (`stage_and_write`): one writer per bin file, pwritev from the executor, every
   item hashed as it is written, each file fsynced before this rank reports;
3. report: one `WriteResult` per stored item (a chunk of a tensor, or a pickled value), whose
   `storage_data` (`ItemWritten`) carries what DCP's `.metadata` and asynctron's manifest need.
DCP's plan is written as is, except that a tensor cut into chunks is reported chunk by chunk
(the coordinator's `finish` lists the chunks in the metadata, as a sharded tensor's are).
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan as DcpSavePlan
from torch.distributed.checkpoint.planner import SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from asynctron.dcp._runtime import Runtime
from asynctron.engine.lowlevel import (
    SaveRequest,
    build_request,
    dcp_items,
    file_plan,
    stage_and_write,
)
from asynctron.storage import ItemRecord, SaveArea
from asynctron.storage.backends import SaveStorage
from asynctron.storage.format import FlatStateDict, ItemKind, SavePlan, check_object_blob


@dataclass(frozen=True, slots=True)
class SaveTarget:
    """Which files a rank writes, as the coordinator's global plan tells it (`storage_data` of
    each rank's final `SavePlan`). The same for every save: DCP's plan caching hands later saves
    the first one's plans, so nothing per save (such as its area) may be carried here."""

    rank: int
    """The rank's index in DCP's plan: its files are `__<rank>_<bin>.distcp`."""


@dataclass(frozen=True, slots=True)
class ItemWritten:
    """One stored item, as a rank reports it to the coordinator (`WriteResult.storage_data`)."""

    storage: _StorageInfo
    """Where DCP finds the item: its whole `torch.save` blob (DCP's `.metadata` entry)."""
    record: ItemRecord
    """asynctron's manifest record: the raw tensor bytes inside the blob, with their digest."""
    file_bytes: int
    """The size of the item's data file."""


async def write(runtime: Runtime, plan: DcpSavePlan, planner: SavePlanner,
                storage: SaveStorage, area: SaveArea,
                ready: Mapping[torch.device, torch.cuda.Event]
                ) -> list[WriteResult]:
    """Write this rank's share of a DCP save into the save's area (the coordinator made it),
    every file durable.

    Raises:
        TypeError: a dtype asynctron cannot store (naming the key).
        StorageError: a write, fsync or close failed (naming the file).

    Cancellation: copies and writes in flight finish; the files left in the area are removed
    with it by the coordinator.
    """
    target = plan.storage_data
    assert isinstance(target, SaveTarget)
    config, run_blocking = runtime.config, runtime.run_blocking
    # Handed over in a box emptied here: the executor's futures sit in reference cycles, which
    # would keep the request (and the tensors it points at, e.g. a staged copy) until the
    # next garbage collection.
    request = (await run_blocking(_request, plan, planner, target.rank, config.num_bins,
                                  config.slab_bytes, config.checksum is not None)).pop()
    await stage_and_write(request, storage, area, runtime.resources, snapshot=False,
                          direct_io=config.direct_io, ready=ready, on_staged=lambda: None)
    return await run_blocking(_results, request, target.rank)


def _request(plan: DcpSavePlan, planner: SavePlanner, rank: int, num_bins: int,
             slab_bytes: int, checksum: bool) -> list[SaveRequest]:
    """Blocks (CPU-bound): DCP's final plan as asynctron's request (in a one-item list):
    pickled values resolved now (DCP's planner `torch.save`s them) and refused if the reader
    would refuse them (TypeError naming the key), tensors resolved where the request takes
    their addresses; nothing is copied."""
    kinds: dict[str, ItemKind] = {}
    pickled: dict[str, bytes] = {}
    for item in plan.items:
        key = item.index.fqn
        if item.type == WriteItemType.BYTE_IO:
            data = planner.resolve_data(item)
            pickled[key] = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
            check_object_blob(pickled[key], key=key)  # no value the reader would refuse
            kinds[key] = "object"
        else:
            kinds[key] = "tensor"
    flat = FlatStateDict(structure_json='{"dict":[]}', values=dict.fromkeys(kinds),
                         kinds=kinds, arrays={})
    save_plan = SavePlan(flat=flat, items=list(plan.items), metadata=None,
                         planner=planner,  # type: ignore[arg-type]  (any SavePlanner)
                         pickled=pickled)
    layout, sources = file_plan(flat, dcp_items(save_plan), num_bins=num_bins,
                                rank=rank, slab_bytes=slab_bytes,
                                torch_save_frames=True)
    return [build_request(flat, layout,
                          (save_plan, [save_plan.items[source] for source in sources]),
                          checksum=checksum)]


def _results(request: SaveRequest, rank: int) -> list[WriteResult]:
    """Blocks: once every file is written, one `WriteResult` per stored item."""
    report = request.report(rank)
    checksums = report.checksums or (None,) * len(report.records)
    results = []
    for record, digest, frame in zip(report.records, checksums, report.frames, strict=True):
        record = dataclasses.replace(record, checksum=digest)
        if frame is None:  # a pickled value: its blob is the item
            index = MetadataIndex(record.key)
            storage = _StorageInfo(record.file, record.offset, record.nbytes)
        else:
            assert record.chunk_offsets is not None
            head, tail = frame
            index = MetadataIndex(record.key, torch.Size(record.chunk_offsets))
            storage = _StorageInfo(record.file, record.offset - head,
                                   head + record.nbytes + tail)
        results.append(WriteResult(index=index, size_in_bytes=storage.length,
                                   storage_data=ItemWritten(storage, record,
                                                            report.files[record.file])))
    return results
