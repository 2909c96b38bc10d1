"""The engine: the loop-bound `Engine`, its handles, the background runner, the budget and the
process-wide staging memory."""

from asynctron._budget import BudgetStatistics, ByteBudget
from asynctron.engine._engine import Engine, EngineConfig
from asynctron.engine._oneshot import load, load_into, save
from asynctron.engine._runner import BackgroundEngine
from asynctron.engine._slabs import SlabCacheStatistics, free_idle_staging, staging_statistics
from asynctron.engine._task import Milestone, SaveResult, SaveTask
from asynctron.engine.tiers import RestoreResult, Tiers

__all__ = [
    "BackgroundEngine",
    "BudgetStatistics",
    "ByteBudget",
    "Engine",
    "EngineConfig",
    "Milestone",
    "RestoreResult",
    "SaveResult",
    "SaveTask",
    "SlabCacheStatistics",
    "Tiers",
    "free_idle_staging",
    "load",
    "load_into",
    "save",
    "staging_statistics",
]

# The seam asynctron's own plugins (the DCP storage plugins) build on: kept for them, not
# promised to users (not in `__all__`).
from asynctron.engine._pipeline import stage_and_write as stage_and_write
from asynctron.engine._resources import SaveResources as SaveResources
from asynctron.engine._save_plan import SaveRequest as SaveRequest
from asynctron.engine._save_plan import build_request as build_request
from asynctron.engine._save_plan import dcp_items as dcp_items
from asynctron.engine._save_plan import file_plan as file_plan
from asynctron.engine._slab_fill import SlabFill as SlabFill
from asynctron.engine._slab_fill import SlabFiller as SlabFiller
from asynctron.engine._slabs import SLAB_CACHE as SLAB_CACHE
from asynctron.engine._slabs import Slab as Slab
from asynctron.engine._staging import launch_copies as launch_copies
from asynctron.engine._staging import mark_ready as mark_ready
