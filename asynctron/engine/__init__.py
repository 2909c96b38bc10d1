"""The engine: the loop-bound `Engine`, its handles, the background runner, the budget and the
process-wide staging memory."""

from asynctron._budget import BudgetStatistics, ByteBudget
from asynctron.engine._config import EngineConfig
from asynctron.engine._engine import Engine
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
