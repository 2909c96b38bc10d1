"""The commit's rename never replaces anything, and the pointer names only what committed."""

from __future__ import annotations

import os

import pytest

from asynctron.storage.backends.local import _publish as _commit
from asynctron.storage.node_files import _sysio


@pytest.mark.parametrize("occupant", ["empty_dir", "file", "dangling_link"])
def test_the_commit_rename_refuses_any_existing_target(tmp_path: os.PathLike[str],
                                                       occupant: str) -> None:
    """Invariant: a plain rename(2) would silently replace an empty directory; ours refuses."""
    tmp_dir, final = os.path.join(tmp_path, ".step.tmp"), os.path.join(tmp_path, "step")
    os.mkdir(tmp_dir)
    if occupant == "empty_dir":
        os.mkdir(final)
    elif occupant == "file":
        open(final, "w").close()
    else:
        os.symlink("nowhere", final)
    with pytest.raises(FileExistsError):
        _commit.publish_dir(tmp_dir, final)
    assert os.path.isdir(tmp_dir) and os.path.lexists(final)


def test_an_empty_directory_appearing_after_any_check_is_not_replaced(
        tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The target appears between a check and the rename (no check sees it): the kernel's
    no-replace rename still refuses."""
    tmp_dir, final = os.path.join(tmp_path, ".step.tmp"), os.path.join(tmp_path, "step")
    os.mkdir(tmp_dir)
    os.mkdir(final)
    monkeypatch.setattr(os.path, "lexists", lambda path: False)
    with pytest.raises(FileExistsError):
        _sysio.rename_no_replace(tmp_dir, final)
    assert os.path.isdir(tmp_dir)
