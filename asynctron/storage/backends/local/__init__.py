"""The local (POSIX) filesystem backend: everything asynctron does with `os`, `fcntl` and
`mmap` on storage lives in this folder."""

from asynctron.storage.backends.local._backend import LocalBackend

__all__ = ["LocalBackend"]
