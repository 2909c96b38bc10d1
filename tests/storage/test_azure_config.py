"""`AzureConfig`: the account a connection string names."""

from __future__ import annotations

from asynctron.storage.backends.azure import AzureConfig


def test_use_development_storage_is_the_emulators_account() -> None:
    """The SDK's shortcut names Azurite's one account, as the SDK reads it."""
    url, name, key, credential = AzureConfig(
        connection_string="UseDevelopmentStorage=true").resolved()
    assert (url, name) == ("http://127.0.0.1:10000/devstoreaccount1", "devstoreaccount1")
    assert key is not None and key.endswith("KBHBeksoGMGw==")
    assert credential == {"account_name": "devstoreaccount1", "account_key": key}


def test_use_development_storage_at_a_proxy() -> None:
    url, *_ = AzureConfig(connection_string="UseDevelopmentStorage=true;"
                                            "DevelopmentStorageProxyUri=http://azurite/").resolved()
    assert url == "http://azurite:10000/devstoreaccount1"
