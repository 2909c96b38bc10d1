"""The save pipeline's parts, for code that drives a save of its own format through the
engine's staging and writers: asynctron's DCP storage plugins. A trainer wants
`asynctron.engine` instead.

    request = build_request(...)          # a state dict's items, planned into bins
    await stage_and_write(...)            # staged through the slab cache, written, durable

`__all__` is this face, frozen by `tests/test_public_api.py`.
"""

from asynctron.engine._pipeline import stage_and_write
from asynctron.engine._resources import SaveResources
from asynctron.engine._save_plan import SaveRequest, build_request, dcp_items, file_plan
from asynctron.engine._slab_fill import SlabFill, SlabFiller
from asynctron.engine._slabs import SLAB_CACHE, Slab
from asynctron.engine._staging import launch_copies, mark_ready

__all__ = ["SLAB_CACHE", "SaveRequest", "SaveResources", "Slab", "SlabFill", "SlabFiller",
           "build_request", "dcp_items", "file_plan", "launch_copies", "mark_ready",
           "stage_and_write"]
