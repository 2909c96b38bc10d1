"""The engine: the loop-bound `Engine`, its handles, the background runner, the budget."""

from asynctron._budget import BudgetStatistics, ByteBudget
from asynctron.engine._engine import Engine, EngineConfig
from asynctron.engine._oneshot import load, save
from asynctron.engine._runner import BackgroundEngine
from asynctron.engine._task import Milestone, SaveResult, SaveTask

__all__ = [
    "BackgroundEngine",
    "BudgetStatistics",
    "ByteBudget",
    "Engine",
    "EngineConfig",
    "Milestone",
    "SaveResult",
    "SaveTask",
    "load",
    "save",
]
