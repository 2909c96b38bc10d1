"""The commit protocol: a checkpoint becomes visible all at once, or not at all.

Stages (all blocking; run on the engine's executor):
1. the writers fsync every data file in the save's tmp dir beside it, `.asynctron.tmp-<hex>`
   (`tmp_dir_for`), whose name holds nothing of `<name>`;
2. `seal_dir`: write + fsync `manifest.json`, fsync the tmp dir; `publish_dir`: rename it
   to `<name>` (never over an existing path), fsync the parent;
3. `point_latest`: replace `<parent>/latest` atomically with the new name.
A crash before the rename leaves only a tmp dir, which no reader takes for a checkpoint (and
the next commit removes, see `_retention`): not asynctron's, which skip tmp dir names, nor a
scan that picks checkpoints by name (torchtitan resumes from the newest folder named
`step-<digits>` that holds a `.metadata`), since nothing of the checkpoint's name is in it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
from collections.abc import Mapping

from asynctron.errors import CheckpointNotFoundError, StorageError
from asynctron.storage.format import MANIFEST_NAME
from asynctron.storage.format import METADATA_NAME as DCP_METADATA_NAME
from asynctron.storage.node_files import _sysio

LATEST_NAME = "latest"
TMP_MARK = ".tmp-"
TMP_DIR_PREFIX = f".asynctron{TMP_MARK}"
"""How every tmp dir asynctron makes beside a checkpoint is named: this, then hex digits."""


def tmp_dir_for(final_path: str, area: str | None = None) -> str:
    """A tmp dir beside `final_path`, `.asynctron.tmp-<hex>`, with nothing of its name in it.

    Args:
        area: names the tmp dir: `<hex>` is a digest of the checkpoint's name and `area`, the
            same in every process (a DCP save's ranks find it so). None makes a fresh one,
            `<hex>` random.
    """
    parent, name = os.path.split(os.path.abspath(final_path))
    if area is None:
        key = secrets.token_hex(8)
    else:
        key = hashlib.sha256(f"{name}\0{area}".encode()).hexdigest()[:16]
    return os.path.join(parent, TMP_DIR_PREFIX + key)


def is_tmp_dir_name(name: str) -> bool:
    """Whether `name` is a tmp dir's (`tmp_dir_for`'s, or `.<name>.tmp-…`, as earlier
    versions named them), never a checkpoint's."""
    return name.startswith(".") and TMP_MARK in name


def staging_path(path: str) -> str:
    """A fresh name beside the small file `path` to write it under before replacing it."""
    return f"{path}{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}"


def seal_dir(tmp_dir: str, files: Mapping[str, bytes]) -> None:
    """Write `files` (the manifest) into `tmp_dir`, whose data files are already fsynced, and
    make its entries durable: ready for `publish_dir`."""
    for name, data in files.items():
        _sysio.write_small_file(os.path.join(tmp_dir, name), data)
    _sysio.fsync_dir(tmp_dir)


def publish_dir(tmp_dir: str, final_path: str) -> None:
    """Rename the sealed `tmp_dir` to `final_path`: the commit.

    Raises:
        FileExistsError: `final_path` appeared meanwhile; the tmp dir is left for the caller.
        StorageError: the rename failed, or the directory fsync after it (then the rename is
            undone): `tmp_dir` still holds the save, uncommitted.
    """
    _sysio.rename_no_replace(tmp_dir, final_path)
    try:
        _sysio.fsync_dir(os.path.dirname(os.path.abspath(final_path)))
    except StorageError:
        # The rename may not survive a crash: un-publish, so failure means "not committed".
        with contextlib.suppress(OSError):
            os.rename(final_path, tmp_dir)
        raise


def point_latest(final_path: str) -> None:
    """Atomically make `<parent>/latest` name the checkpoint at `final_path`."""
    parent, name = os.path.split(os.path.abspath(final_path))
    pointer = os.path.join(parent, LATEST_NAME)
    staging = staging_path(pointer)
    _sysio.write_small_file(staging, (name + "\n").encode())
    _sysio.replace_file(staging, pointer)
    _sysio.fsync_dir(parent)


def read_latest(root: str) -> str | None:
    """The checkpoint path `<root>/latest` names, or None if there is no pointer."""
    pointer = os.path.join(root, LATEST_NAME)
    if not _sysio.is_file(pointer):
        return None
    name = _sysio.read_small_file(pointer, 4096).decode(errors="replace").strip()
    if not name or "/" in name or name in (".", "..") or "\x00" in name:
        raise CheckpointNotFoundError(
            f"pointer {pointer}: expected a checkpoint name, found {name!r}; rewrite or remove it",
            path=pointer,
        )
    return os.path.join(root, name)


def is_committed(path: str) -> bool:
    """Whether `path` holds a committed checkpoint: asynctron's (`manifest.json`) or a stock
    torch.distributed.checkpoint one (`.metadata`)."""
    return _sysio.is_file(os.path.join(path, MANIFEST_NAME)) or is_dcp_checkpoint(path)


def resolve_checkpoint(path: str) -> str:
    """The committed checkpoint at `path`, or the one `path/latest` names. A pointer whose
    checkpoint is gone is read again: a writer with `keep_last` moves it to the next commit
    before pruning the one it named, so if it moved meanwhile, it names a committed one.

    Raises:
        CheckpointNotFoundError: neither a checkpoint nor a `latest` pointer naming one is at
            `path` (the message says whether `path` exists).
    """
    if is_committed(path):
        return path
    named = None
    while os.path.isdir(path) and (latest := read_latest(path)) not in (None, named):
        if is_committed(latest):
            return latest
        named = latest
    if named is not None:
        raise CheckpointNotFoundError(
            f"checkpoint {path}: its '{LATEST_NAME}' pointer names {named}, which holds no "
            f"committed checkpoint ({MANIFEST_NAME} or DCP's {DCP_METADATA_NAME}); it was "
            "removed, or its save never committed",
            path=named,
        )
    if not os.path.lexists(path):
        raise CheckpointNotFoundError(
            f"checkpoint {path}: expected a committed checkpoint, found nothing: the path "
            "does not exist",
            path=path,
        )
    raise CheckpointNotFoundError(
        f"checkpoint {path}: expected a committed checkpoint ({MANIFEST_NAME} or DCP's "
        f"{DCP_METADATA_NAME}) or a '{LATEST_NAME}' pointer, found none; the save may not "
        "have committed",
        path=path,
    )


def is_dcp_checkpoint(path: str) -> bool:
    return _sysio.is_file(os.path.join(path, DCP_METADATA_NAME))
