"""Atomic file writes: a reader sees the old file or the complete new one, never half of it.

Every file the package writes that someone else may read at the same time (a plan, a cluster or
model profile in a shared cache, the checkpoint ``latest`` marker, dataset ``.bin``/``.idx``
pairs and their index caches) goes through this module. The new content is written to a
private temporary file in the target's directory and renamed over the target with
``os.replace``, which POSIX makes atomic within one file system. The temporary name comes from
``tempfile.mkstemp`` (created with ``O_EXCL``), so concurrent writers, also on other hosts
sharing the file system, never collide; writers of identical content (ranks building the same
cache) are therefore safe, the last rename wins.

- :func:`atomic_write` for content already in memory;
- :func:`atomic_open` (a context manager) to stream into the file; an exception inside the
  ``with`` block discards the temporary file and leaves the target untouched;
- :class:`AtomicFile` when the file stays open across calls (the dataset builder), with an
  explicit :meth:`AtomicFile.commit` / :meth:`AtomicFile.abort`.

``durable=True`` also ``fsync``s the data before the rename, for markers that must not point at
data a power loss could still take back (the checkpoint ``latest`` file).

Pure standard library, so every layer of the package may use it.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import IO, Any, Iterator


def _read_umask() -> int:
    mask = os.umask(0)  # the only way to read it; set back at once (at import, single-threaded)
    os.umask(mask)
    return mask


_UMASK = _read_umask()


class AtomicFile:
    """A temporary file that becomes ``path`` on :meth:`commit` (or vanishes on :meth:`abort`).

    ``mode`` is ``"w"`` (text, ``encoding``) or ``"wb"``. The directory of ``path`` must exist.
    """

    def __init__(self, path: str | os.PathLike, mode: str = "w", *, encoding: str = "utf-8",
                 durable: bool = False) -> None:
        if mode not in ("w", "wb"):
            raise ValueError(f"AtomicFile mode={mode!r}: use 'w' (text) or 'wb' (binary)")
        self.path = os.fspath(path)
        self.durable = durable
        directory, name = os.path.split(os.path.abspath(self.path))
        fd, self.tmp_path = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
        try:
            self.file: IO[Any] = (os.fdopen(fd, "wb") if mode == "wb"
                                  else os.fdopen(fd, "w", encoding=encoding))
        except BaseException:
            os.close(fd)
            os.remove(self.tmp_path)
            raise
        self._done = False

    def commit(self) -> None:
        """Close the temporary file and rename it over ``path`` (idempotent)."""
        if self._done:
            return
        try:
            self.file.flush()
            if self.durable:
                os.fsync(self.file.fileno())
            self.file.close()
            # mkstemp creates the file 0600; give it the permissions a plain open() would.
            os.chmod(self.tmp_path, 0o666 & ~_UMASK)
            os.replace(self.tmp_path, self.path)
        except BaseException:
            self.abort()
            raise
        self._done = True

    def abort(self) -> None:
        """Discard what was written; ``path`` is left as it was (idempotent)."""
        if self._done:
            return
        self._done = True
        self.file.close()
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.tmp_path)

    def __enter__(self) -> IO[Any]:
        return self.file

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", *, encoding: str = "utf-8",
                durable: bool = False) -> Iterator[IO[Any]]:
    """``with atomic_open(path) as f: f.write(...)``: ``path`` appears complete when the block
    ends without an exception, and is not touched otherwise."""
    with AtomicFile(path, mode, encoding=encoding, durable=durable) as fh:
        yield fh


def atomic_write(path: str | os.PathLike, data: str | bytes, *, encoding: str = "utf-8",
                 durable: bool = False) -> None:
    """Replace ``path`` by ``data`` (text or bytes) atomically."""
    mode = "wb" if isinstance(data, (bytes, bytearray)) else "w"
    with atomic_open(path, mode, encoding=encoding, durable=durable) as fh:
        fh.write(data)
