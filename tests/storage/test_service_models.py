"""The S3 client's botocore loader: the services it knows, found without listing every
service's directory (each `stat` a GIL release: 25 s to create a client beside a thread busy in
Python, against 1.3 s with this loader)."""

from __future__ import annotations

import os

import pytest
from botocore.exceptions import UnknownServiceError
from botocore.session import Session

from asynctron.storage.backends.s3._service_models import (
    SERVICES,
    ServiceModelLoader,
    use_service_model_loader,
)


def test_the_loader_knows_our_services_without_listing_them_all(
        monkeypatch: pytest.MonkeyPatch) -> None:
    listed: list[str] = []
    real_listdir = os.listdir

    def listdir(path: str) -> list[str]:
        listed.append(os.path.basename(os.path.normpath(path)))
        return real_listdir(path)

    monkeypatch.setattr(os, "listdir", listdir)
    assert ServiceModelLoader().list_available_services("service-2") == list(SERVICES)
    assert set(listed) <= set(SERVICES), listed  # each service's own directory, nothing else


def test_a_session_with_it_makes_s3_clients_and_names_a_service_it_lacks() -> None:
    session = Session()
    use_service_model_loader(session)
    client = session.create_client("s3", region_name="us-east-1",
                                   endpoint_url="http://127.0.0.1:1",
                                   aws_access_key_id="a", aws_secret_access_key="b")
    assert client.meta.service_model.service_name == "s3"
    assert client.generate_presigned_url("get_object", {"Bucket": "b", "Key": "k"})
    with pytest.raises(UnknownServiceError, match="dynamodb"):
        session.create_client("dynamodb", region_name="us-east-1")
