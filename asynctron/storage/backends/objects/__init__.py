"""Object stores: the commit protocol, the writers, the readers and the dataset files,
written once against `ObjectClient`; each cloud brings one client (`s3/`, `azure/`).

    ObjectStoreBackend(client)       # a Backend over any ObjectClient
"""

from asynctron.storage.backends.objects._backend import ObjectStoreBackend
from asynctron.storage.backends.objects._client import (
    ObjectClient,
    ObjectInfo,
    ObjectReads,
    ObjectWrites,
    OpenUpload,
    PartLimits,
    PartUploads,
    PreconditionFailedError,
)
from asynctron.storage.backends.objects._layout import Listing, ObjectUrl
from asynctron.storage.backends.objects._store_config import StoreConfig

__all__ = ["Listing", "ObjectClient", "ObjectInfo", "ObjectReads", "ObjectStoreBackend",
           "ObjectUrl", "ObjectWrites", "OpenUpload", "PartLimits", "PartUploads",
           "PreconditionFailedError", "StoreConfig"]
