"""What the DCP plugins (`StorageWriter`, `StorageReader`, `AsyncStager`) hold alike: their
engine options and the process's runtime for them, started on first use (`Plugin`); and, for
the writer and the reader, the checkpoint: its path and the backend that serves it
(`CheckpointPlugin`, `locate`, `is_served`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from asynctron.dcp._runtime import Runtime, plugin_config, runtime_for
from asynctron.storage import Backend, backend_for


def locate(owner: str, path: str | os.PathLike[str], backend: Backend | None
           ) -> tuple[Backend, str]:
    """`path`'s backend (`backend`, else the one its URL names) and its name there.

    Raises:
        TypeError: `path` is not a str or os.PathLike (naming the owner).
        ValueError: an empty path, or a URL no backend serves.
    """
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"{owner} path: expected a str or os.PathLike, found "
                        f"{type(path).__name__}")
    text = os.fspath(path)
    if not isinstance(text, str) or not text:
        raise ValueError(f"{owner} path: expected a non-empty path, found {path!r}")
    served = backend or backend_for(text)
    return served, served.locate(text)


def is_served(checkpoint_id: object) -> bool:
    """Whether a storage backend serves `checkpoint_id` (a local path, or a URL of a
    registered backend): what the plugins save to and load from."""
    try:
        locate("checkpoint_id", checkpoint_id, None)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    return True


class Plugin:
    """A DCP plugin's engine options, validated at construction (errors name `owner`), and
    the process's runtime for them and `backend` (`_started`: started on first use)."""

    def __init__(self, owner: str, engine_options: Mapping[str, Any],
                 backend: Backend | None = None) -> None:
        super().__init__()
        self._given_backend = backend
        self._config = plugin_config(owner, engine_options)
        self._runtime: Runtime | None = None

    def _started(self) -> Runtime:
        if self._runtime is None:
            self._runtime = runtime_for(self._config, self._given_backend)
        return self._runtime


class CheckpointPlugin(Plugin):
    """A plugin that writes or reads one checkpoint: its path, and the backend that serves it
    (`backend`, else the path's own); `reset` moves it (`_relocate`).

    Raises:
        TypeError, ValueError: a bad path (`locate`), before any option is checked.
    """

    def __init__(self, owner: str, path: str | os.PathLike[str], backend: Backend | None,
                 engine_options: Mapping[str, Any]) -> None:
        self._owner = owner
        self._backend, self.path = locate(owner, path, backend)
        super().__init__(owner, engine_options, backend)

    @property
    def checkpoint_id(self) -> str:
        """The checkpoint path this plugin writes or reads."""
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether a storage backend serves `checkpoint_id` (what this plugin writes or
        reads)."""
        return is_served(checkpoint_id)

    def _relocate(self, checkpoint_id: str | os.PathLike[str] | None) -> None:
        """Move to `checkpoint_id`, where one is given (`reset`'s)."""
        if checkpoint_id:
            self._backend, self.path = locate(self._owner, checkpoint_id, self._given_backend)
