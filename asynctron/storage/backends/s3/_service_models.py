"""botocore's service models, loaded without its scan of every service's directory.

To check a service's name, botocore's loader lists the directory of each of the ~400 services
it knows, for each kind of model a client loads: thousands of `stat`s, each releasing the GIL.
Beside a thread busy in Python (a trainer), a thread that releases the GIL waits a switch
interval (5 ms) to take it back, so creating one S3 client took 25 s there (0.1 s in an idle
process). This loader asks only about the services a client of ours can load.
"""

from __future__ import annotations

import os

from botocore.exceptions import DataNotFoundError
from botocore.loaders import Loader
from botocore.session import Session

SERVICES = ("s3", "sso", "sso-oidc", "sts")
"""S3, and the services botocore's credential providers call (assume role, SSO)."""


class ServiceModelLoader(Loader):
    """botocore's `Loader`, knowing only `SERVICES` (those it has models of)."""

    def list_available_services(self, type_name: str) -> list[str]:
        return [name for name in SERVICES if self._has_model(name, type_name)]

    def _has_model(self, service_name: str, type_name: str) -> bool:
        try:
            return bool(self.list_api_versions(service_name, type_name))
        except DataNotFoundError:
            return False


def use_service_model_loader(session: Session) -> None:
    """Make `session`'s clients load their models through a `ServiceModelLoader` (with the
    session's `data_path`, as botocore's own loader)."""
    data_path = session.get_config_variable("data_path")
    paths = ([os.path.expanduser(os.path.expandvars(path))
              for path in data_path.split(os.pathsep)] if data_path else [])
    session.register_component("data_loader", ServiceModelLoader(extra_search_paths=paths))
