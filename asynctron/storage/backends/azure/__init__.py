"""Checkpoints and datasets on Azure Blob Storage: `az://container/key` (also `abfs://`) URLs.

    engine.save(state_dict, "az://container/run/step_100")  # AZURE_STORAGE_* settings' account
    Engine(backend=AzureBackend(AzureConfig(connection_string=...)))  # or configured in code
"""

from asynctron.storage.backends.azure._backend import AzureBackend
from asynctron.storage.backends.azure._config import AzureConfig

__all__ = ["AzureBackend", "AzureConfig"]
