"""Damaged or hostile checkpoints: every load raises an error naming the file, key and offset."""

from __future__ import annotations

import json
import os

import pytest
import torch

from asynctron import CheckpointNotFoundError, CorruptCheckpointError, Engine

SMALL = {"slab_bytes": 64 << 10, "memory_budget_bytes": 256 << 10}


async def _save(root: str) -> tuple[str, dict]:
    path = f"{root}/ckpt"
    async with Engine(num_bins=1, **SMALL) as engine:
        await engine.save({"a": torch.arange(1000.0), "b": torch.ones(5000), "n": 1}, path)
    with open(f"{path}/manifest.json") as f:
        return path, json.load(f)


def _item(manifest: dict, key: str) -> dict:
    return next(item for item in manifest["items"] if item["key"] == key)


async def _load(path: str, **kwargs: object) -> object:
    async with Engine(**SMALL) as engine:
        return await engine.load(path, **kwargs)


async def test_flipped_byte_names_file_key_and_offset(shm_path: str) -> None:
    path, manifest = await _save(shm_path)
    b = _item(manifest, "b")
    with open(f"{path}/{b['file']}", "r+b") as f:
        f.seek(b["offset"] + 1234)
        byte = f.read(1)
        f.seek(b["offset"] + 1234)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(CorruptCheckpointError,
                       match=rf"^item 'b' in {path}/__0_0\.distcp at offset {b['offset']}: "
                             r"expected xxh3_64 [0-9a-f]{16}, found [0-9a-f]{16}; the file "
                             r"changed after commit$") as e:
        await _load(path)
    assert (e.value.key, e.value.offset) == ("b", b["offset"])
    await _load(path, verify=False)  # the caller may choose to skip verification
    with pytest.raises(CorruptCheckpointError, match=r"^item 'b'"):
        await _load(path, mmap=True, verify=True)


async def test_truncated_file_names_the_cut_items(shm_path: str) -> None:
    path, manifest = await _save(shm_path)
    os.truncate(f"{path}/__0_0.distcp", _item(manifest, "b")["offset"] + 10)
    with pytest.raises(CorruptCheckpointError,
                       match=rf"^file {path}/__0_0\.distcp: expected \d+ bytes, found \d+; "
                             r"items \['b'\] are cut") as e:
        await _load(path)
    assert e.value.key == "b"


async def test_missing_file_and_missing_checkpoint(shm_path: str) -> None:
    path, _ = await _save(shm_path)
    with pytest.raises(CheckpointNotFoundError, match=r"^checkpoint .*/nope: expected a "
                                                      r"committed checkpoint, found nothing: "
                                                      r"the path does not exist$"):
        await _load(f"{shm_path}/nope")
    os.mkdir(f"{shm_path}/empty")  # a folder, but no save committed in it
    with pytest.raises(CheckpointNotFoundError, match=r"^checkpoint .*/empty: expected a "
                                                      r"committed checkpoint .* found none; "
                                                      r"the save may not have committed$"):
        await _load(f"{shm_path}/empty")
    os.remove(f"{path}/__0_0.distcp")
    with pytest.raises(CorruptCheckpointError, match=r"expected \d+ bytes, found no file"):
        await _load(path)


def _rewrite(path: str, manifest: dict) -> None:
    with open(f"{path}/manifest.json", "w") as f:
        json.dump(manifest, f)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m.update(format="pickle"), r"expected format 'asynctron', found 'pickle'"),
        (lambda m: m.update(version=99), r"expected version 1, found 99"),
        (lambda m: m["files"].update({"../../etc/passwd": 10}),
         r"file name '\.\./\.\./etc/passwd': expected __<rank>_<bin>\.distcp"),
        (lambda m: m["items"][0].update(file="/etc/passwd"),
         r"item 'a' file '/etc/passwd': expected one of the manifest's files"),
        (lambda m: m["items"][0].update(offset=10**15),
         r"item 'a' bytes \[1000000000000000, \+4000\): expected inside __0_0\.distcp"),
        (lambda m: m["items"][0].update(dtype="os.system"), r"item 'a' dtype 'os\.system'"),
        (lambda m: m["items"][0].update(shape=[10**6], global_shape=[10**6]),
         r"item 'a': expected 4000000 bytes for float32 \[1000000\], found nbytes 4000"),
        (lambda m: m["items"][0].update(checksum=-1), r"item 'a' checksum -1: expected 16 "),
        (lambda m: m.update(checksum="md5"), r"field 'checksum': expected one of"),
        (lambda m: m["items"].append(dict(m["items"][0])),
         r"item 'a': chunk at \[0\] of shape \[1000\] overlaps the chunk at \[0\]"),
        (lambda m: m["items"][0].update(global_shape=[2000]),
         r"item 'a': expected chunks covering all 2000 elements of shape \[2000\], found 1000"),
        (lambda m: m["items"].append(dict(m["items"][0], chunk_offsets=[1000],
                                          global_shape=[2000])),
         r"item 'a': expected every chunk with one kind, dtype and global shape"),
        (lambda m: m.update(structure={"item": "ghost"}),
         r"structure references item 'ghost', which the manifest lacks"),
        (lambda m: m.update(structure={"eval": "x"}), r"structure tag 'eval'"),
        (lambda m: m["items"][0].update(shape=[0, 10**30], global_shape=[0, 10**30],
                                        chunk_offsets=[0, 0], nbytes=0),
         r"item 'a': expected shape, global_shape and chunk_offsets as lists of one length "
         r"\(at most 64\) of integers in \[0, 2\*\*63\)"),
        (lambda m: m["items"][0].update(shape=[0, 2**62, 2**62], global_shape=[0, 2**62, 2**62],
                                        chunk_offsets=[0, 0, 0], nbytes=0),
         r"item 'a' global_shape \[0, 4611686018427387904, 4611686018427387904\]: expected a "
         r"shape torch can hold"),
    ],
)
async def test_hostile_manifest_is_refused(shm_path: str, edit: object, message: str) -> None:
    path, manifest = await _save(shm_path)
    edit(manifest)  # type: ignore[operator]
    _rewrite(path, manifest)
    with pytest.raises(CorruptCheckpointError,
                       match=rf"^manifest {path}/manifest\.json: {message}"):
        await _load(path)


@pytest.mark.parametrize("target", ["manifest.json", "__0_0.distcp"])
async def test_a_linked_file_is_refused_not_followed(shm_path: str, target: str) -> None:
    """A checkpoint's files may not lead out of it: a symbolic link is refused by name."""
    path, _ = await _save(shm_path)
    os.rename(f"{path}/{target}", f"{shm_path}/outside")
    os.symlink(f"{shm_path}/outside", f"{path}/{target}")
    with pytest.raises(CorruptCheckpointError,
                       match=rf"^file {path}/{target}: expected a regular file, found a symbolic "
                             r"link; a checkpoint's files are never followed out of it"):
        await _load(path)


@pytest.mark.timeout(30)
async def test_a_fifo_is_refused_without_waiting_for_a_writer(shm_path: str) -> None:
    path, _ = await _save(shm_path)
    os.remove(f"{path}/__0_0.distcp")
    os.mkfifo(f"{path}/__0_0.distcp")
    with pytest.raises(CorruptCheckpointError, match=rf"^file {path}/__0_0\.distcp: expected a "
                                                     r"regular file, found a FIFO; "):
        await _load(path)


async def test_overlapping_items_are_refused(shm_path: str) -> None:
    path, manifest = await _save(shm_path)
    _item(manifest, "b").update(offset=_item(manifest, "a")["offset"] + 8)
    _rewrite(path, manifest)
    with pytest.raises(CorruptCheckpointError,
                       match=rf"^manifest {path}/manifest\.json: items '[ab]' and '[ab]' "
                             r"overlap in __0_0\.distcp at offset \d+; "):
        await _load(path)


@pytest.mark.parametrize("payload", [b"{", b"[]", b'{"a": ' * 100_000, b"\xff\xfe"])
async def test_garbage_manifest_is_refused(shm_path: str, payload: bytes) -> None:
    path, _ = await _save(shm_path)
    with open(f"{path}/manifest.json", "wb") as f:
        f.write(payload)
    with pytest.raises(CorruptCheckpointError, match=r"^manifest .*: expected "):
        await _load(path)


async def test_keys_are_names_never_paths(shm_path: str) -> None:
    """Keys like '../x' or '/etc/passwd' are stored as data; nothing is written outside."""
    hostile = {"../../escape": torch.ones(3), "/etc/passwd": b"root", "..": {"/": 1},
               "a/b/../../c": torch.zeros(2)}
    root = f"{shm_path}/inner"
    os.mkdir(root)
    async with Engine(**SMALL) as engine:
        await engine.save(hostile, f"{root}/ckpt")
        loaded = await engine.load(f"{root}/ckpt")
    assert sorted(os.listdir(shm_path)) == ["inner"]
    assert sorted(os.listdir(root)) == ["ckpt", "latest"]
    assert loaded["/etc/passwd"] == b"root" and loaded[".."] == {"/": 1}
    assert torch.equal(loaded["../../escape"], torch.ones(3))


async def test_a_latest_pointer_naming_a_removed_checkpoint_says_so(shm_path: str) -> None:
    await _save(shm_path)
    with open(f"{shm_path}/latest", "w") as f:
        f.write("step_gone\n")
    with pytest.raises(CheckpointNotFoundError, match=rf"^checkpoint {shm_path}: its 'latest' "
                                                      rf"pointer names {shm_path}/step_gone, "
                                                      "which holds no committed checkpoint"):
        await _load(shm_path)


async def test_bad_latest_pointer(shm_path: str) -> None:
    await _save(shm_path)
    with open(f"{shm_path}/latest", "w") as f:
        f.write("../../etc")
    with pytest.raises(CheckpointNotFoundError, match=r"expected a checkpoint name, found "
                                                      r"'\.\./\.\./etc'"):
        await _load(shm_path)
