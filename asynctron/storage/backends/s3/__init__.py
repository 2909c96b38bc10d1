"""Checkpoints on S3-compatible object storage: `s3://bucket/key` URLs.

    engine.save(state_dict, "s3://bucket/run/step_100")   # the AWS chain's store
    Engine(backend=S3Backend(S3Config(endpoint_url=...)))  # or one configured in code
"""

from asynctron.storage.backends.s3._backend import S3Backend
from asynctron.storage.backends.s3._config import S3Config

__all__ = ["S3Backend", "S3Config"]
