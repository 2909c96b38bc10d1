"""The storage seam: backends by URL scheme, the local backend's save areas and commits."""

from __future__ import annotations

import asyncio
import os
import pathlib
import re

import pytest

import asynctron
import asynctron.storage.backends
from asynctron.storage import Backend, LocalBackend, SaveArea, backend_for, register_backend
from asynctron.storage.backends import (
    MappableFiles,
    MappedItems,
    RangedFiles,
    serves_ranged_files,
)
from asynctron.testing import FaultyBackend


def test_the_backends_conform_to_the_protocol() -> None:
    assert isinstance(LocalBackend(), Backend)
    assert isinstance(FaultyBackend(), Backend)


_SEAM = [value for value in vars(asynctron.storage.backends).values()
         if isinstance(value, type) and getattr(value, "_is_protocol", False)]


@pytest.mark.parametrize("protocol", _SEAM, ids=lambda protocol: protocol.__name__)
def test_each_part_of_the_seam_is_narrow(protocol: type) -> None:
    """A backend implements a few small Protocols, each split by who calls it, none of more
    than seven operations of its own (a new store implements `ObjectClient`, not these); a
    Protocol that declares none is the union of two or more of them."""
    own = [name for name, value in vars(protocol).items()
           if not name.startswith("_") and (callable(value) or isinstance(value, property))]
    assert len(own) <= 7, own
    if not own:
        assert len([base for base in protocol.__bases__ if base in _SEAM]) >= 2


def test_capabilities_are_types_not_refusals(tmp_path: pathlib.Path) -> None:
    """Mapping and ranged reads are Protocols a backend has or has not: the local filesystem
    maps and an object store reads by range, and neither has a method that only refuses."""
    from asynctron.storage.backends.objects import ObjectStoreBackend

    local = LocalBackend()
    assert isinstance(local, MappableFiles) and not isinstance(local, RangedFiles)
    assert issubclass(ObjectStoreBackend, RangedFiles)
    assert not issubclass(ObjectStoreBackend, MappableFiles)


async def test_only_a_local_checkpoint_reader_maps_its_items(tmp_path: pathlib.Path) -> None:
    from asynctron.storage.backends.objects._reader import ObjectReader

    async with asynctron.Engine() as engine:
        await engine.save({"w": 1}, str(tmp_path / "c"))
        storage = LocalBackend().checkpoints(engine.run_blocking)
        reader = await storage.open_reader(str(tmp_path / "c"), max_files_at_once=4)
        try:
            assert isinstance(reader, MappedItems)
        finally:
            await reader.aclose()
    assert not issubclass(ObjectReader, MappedItems)


def test_a_plain_path_is_served_by_the_one_local_backend() -> None:
    assert isinstance(backend_for("ckpt/step_1"), LocalBackend)
    assert backend_for("/abs/ckpt") is backend_for("rel")
    assert backend_for("ckpt").locate("ckpt/step_1") == os.path.abspath("ckpt/step_1")


@pytest.mark.parametrize("url", ["hdfs://nn/run/step_1", "oss://b/k", "file:///tmp/x"])
def test_a_url_no_backend_serves_is_refused_never_a_local_path(url: str) -> None:
    with pytest.raises(ValueError, match=rf"^path {url!r}: expected a local path or a URL a "
                                         r"storage backend serves .*never taken for a local"):
        backend_for(url)


async def test_a_save_to_a_url_no_backend_serves_writes_nothing(
        tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before the seam, `save(sd, "s3://bucket/x")` wrote `./s3:/bucket/x` and succeeded."""
    monkeypatch.chdir(tmp_path)  # type: ignore[arg-type]
    async with asynctron.Engine() as engine:
        with pytest.raises(ValueError, match="scheme 'hdfs'"):
            engine.save({"w": 1}, "hdfs://nn/run/step_1")
        with pytest.raises(ValueError, match="scheme 'hdfs'"):
            await engine.load("hdfs://nn/run")
    assert os.listdir(".") == []


def test_a_one_call_save_to_a_url_no_backend_serves_writes_nothing(
        tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="scheme 'hdfs'"):
        asynctron.save({"w": 1}, "hdfs://nn/run/step_1")
    assert os.listdir(".") == []


@pytest.mark.parametrize(("path", "meant"), [
    ("s3:/bucket/x", "s3://bucket/x"), ("s3:bucket/x", "s3://bucket/x"),
    ("gs:/b/run", "gs://b/run"), ("run:1", "run://1")])
def test_a_path_that_looks_like_a_mistyped_url_is_refused(path: str, meant: str) -> None:
    """`pathlib.Path("s3://b/x")` is `s3:/b/x`: saved as a local directory `./s3:/b/x`, the
    save would succeed and `verify` would then say "ok" on the local copy."""
    with pytest.raises(ValueError, match=rf"^path {re.escape(repr(path))}: .* did you mean "
                                         rf"{re.escape(repr(meant))}\?.* is written "
                                         rf"{re.escape(repr('./' + path))}$"):
        backend_for(path)
    with pytest.raises(ValueError, match="did you mean"):
        backend_for(pathlib.Path(path))


@pytest.mark.parametrize("path", ["./s3:/bucket/x", "/abs/s3:/x", "ckpt/step:1", "a_b/c"])
def test_a_colon_past_the_first_name_is_a_plain_local_path(path: str) -> None:
    assert isinstance(backend_for(path), LocalBackend)


@pytest.mark.parametrize(("path", "meant"), [
    ("s3//b/x", "s3://b/x"), ("gs//b/x", "gs://b/x"), ("az//c/x", "az://c/x"),
    ("S3//b/x", "s3://b/x"), ("s3a//b/x", "s3://b/x"), ("gcs//b/x", "gs://b/x")])
def test_a_path_that_looks_like_a_url_missing_its_colon_is_refused(path: str, meant: str) -> None:
    """`gs//b/x` was saved to a local `./gs/b/x` with no error."""
    first = path.partition("/")[0]
    with pytest.raises(ValueError, match=rf"^path {re.escape(repr(path))}: .* missing its ':'; "
                                         rf"did you mean {re.escape(repr(meant))}\? A local "
                                         rf"path whose first name is {re.escape(repr(first))} "
                                         rf"is written {re.escape(repr('./' + path))}$"):
        backend_for(path)
    with pytest.raises(ValueError, match=rf"did you mean {re.escape(repr(meant))}\?"):
        serves_ranged_files(path)  # a dataset's path


@pytest.mark.parametrize("path", ["./s3//b/x", "ckpt//step_1", "s3/b/x", "hdfs//b/x"])
def test_a_doubled_slash_after_a_name_no_backend_serves_is_a_plain_local_path(path: str) -> None:
    assert isinstance(backend_for(path), LocalBackend)


@pytest.mark.parametrize(("path", "meant"), [
    ("gcs://b/x", "gs://b/x"), ("GCS://b/x", "gs://b/x"), ("azure://c/x", "az://c/x"),
    ("gcs:/b/x", "gs://b/x"), ("azure:c/x", "az://c/x")])
def test_other_tools_names_of_a_served_store_are_refused_naming_ours(
        path: str, meant: str) -> None:
    """A hint, never served: a checkpoint has one name (`gs://`), whatever tool wrote it."""
    with pytest.raises(ValueError, match=rf"did you mean {re.escape(repr(meant))}\?"):
        backend_for(path)


def test_hadoop_s3_schemes_are_refused_naming_s3() -> None:
    with pytest.raises(ValueError, match=r"found the scheme 's3a'; did you mean 's3://b/x'\?$"):
        backend_for("s3a://b/x")


async def test_a_save_to_a_mistyped_url_writes_nothing(
        tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # type: ignore[arg-type]
    async with asynctron.Engine() as engine:
        with pytest.raises(ValueError, match="did you mean 's3://bucket/x'"):
            engine.save({"w": 1}, "s3:/bucket/x")
        with pytest.raises(ValueError, match="did you mean 'gs://bucket/x'"):
            engine.save({"w": 1}, "gs//bucket/x")
    with pytest.raises(ValueError, match="did you mean 's3://bucket/x'"):
        asynctron.dcp.StorageWriter("s3:/bucket/x")
    assert os.listdir(".") == []


def test_a_one_call_save_to_a_pathlib_url_writes_nothing(
        tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="did you mean 's3://bucket/x'"):
        asynctron.save({"w": 1}, pathlib.Path("s3://bucket/x"))
    assert os.listdir(".") == []


def test_a_registered_scheme_is_served_by_its_factory() -> None:
    made: list[Backend] = []

    def factory() -> Backend:
        made.append(LocalBackend())
        return made[-1]

    register_backend("memtest", factory)
    assert backend_for("memtest://a") is backend_for("MEMTEST://b") is made[0]
    assert len(made) == 1


def test_a_named_area_is_the_same_on_every_rank_a_fresh_one_unique() -> None:
    """Named areas (DCP's, a tier drain's) are the same for the same checkpoint and name,
    distinct otherwise; fresh ones are unique; none holds the checkpoint's name (each is
    `.asynctron.tmp-<hex>`)."""
    backend = LocalBackend().checkpoints(asyncio.to_thread)
    named = backend.area_of("/r/step-4", "dcp")
    assert named == LocalBackend().checkpoints(asyncio.to_thread).area_of("/r/step-4", "dcp")
    others = {backend.area_of("/r/step-5", "dcp").location,
              backend.area_of("/r/step-4", "drain-4").location}
    fresh = {backend.area_of("/r/step-4").location for _ in range(3)}
    locations = {named.location, *others, *fresh}
    assert len(locations) == 6
    for location in locations:
        parent, name = os.path.split(location)
        assert parent == "/r" and re.fullmatch(r"\.asynctron\.tmp-[0-9a-f]{16}", name), name


async def test_a_discarded_area_is_removed_and_an_unknown_one_left(tmp_path: object) -> None:
    """`discard` removes only an area this backend made and still holds (through any of its
    bindings): never a directory it did not make (another process's live save)."""
    backend = LocalBackend()
    async with asynctron.Engine() as engine:
        checkpoints = backend.checkpoints(engine.run_blocking)
        mine = checkpoints.area_of(f"{tmp_path}/mine")
        await checkpoints.start_save(mine)
        assert os.path.isdir(mine.location)
        await backend.checkpoints(asyncio.to_thread).discard(mine)  # another binding's
        assert not os.path.exists(mine.location)
        theirs = SaveArea(f"{tmp_path}/theirs", f"{tmp_path}/.asynctron.tmp-other")
        os.mkdir(theirs.location)
        await checkpoints.discard(theirs)
        assert os.path.isdir(theirs.location)


async def test_a_save_refuses_an_existing_checkpoint_before_making_an_area(
        tmp_path: object) -> None:
    backend = LocalBackend()
    os.mkdir(f"{tmp_path}/step_1")
    async with asynctron.Engine() as engine:
        with pytest.raises(FileExistsError, match="expected a new path"):
            checkpoints = backend.checkpoints(engine.run_blocking)
            await checkpoints.start_save(checkpoints.area_of(f"{tmp_path}/step_1"))
    assert os.listdir(tmp_path) == ["step_1"]  # type: ignore[arg-type]
