"""Checkpoints and datasets on Google Cloud Storage: `gs://bucket/key` URLs.

    engine.save(state_dict, "gs://bucket/run/step_100")     # Application Default Credentials
    Engine(backend=GcsBackend(GcsConfig(endpoint_url=...)))  # or configured in code
"""

from asynctron.storage.backends.gcs._backend import GcsBackend
from asynctron.storage.backends.gcs._config import GcsConfig

__all__ = ["GcsBackend", "GcsConfig"]
