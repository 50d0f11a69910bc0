"""Object storage on the local filesystem: atomic puts and race-safe conditional creates."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import shutil
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from airflow_deadline_batch.exceptions import (
    ConfigurationError,
    ObjectChanged,
    ObjectExists,
    ObjectNotFound,
    StorageError,
)
from airflow_deadline_batch.storage.base import (
    CHUNK_SIZE,
    sha256_hex,
    validate_key,
    validate_prefix,
    validate_range,
)

#: suffix of the temporary files that writes stage their bytes in; listings skip them
TEMP_SUFFIX = ".adb-tmp"
_TEMP_NAME = re.compile(r"^\..*\.[0-9a-f]{32}" + re.escape(TEMP_SUFFIX) + "$")


def is_temp_name(name: str) -> bool:
    """Whether a file name is one of this module's in-flight temporary files."""
    return _TEMP_NAME.match(name) is not None


class LocalStorage:
    """Objects as files under ``root``; a key ``a/b.jsonl`` is the file ``root/a/b.jsonl``.

    Writes go to a temporary file in the target's directory, are fsynced, and then appear under
    their name in one atomic step (``os.replace`` or ``os.link``), so readers never see a prefix.
    """

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root).expanduser().absolute()

    def __repr__(self) -> str:
        return f"LocalStorage({str(self.root)!r})"

    @property
    def base_uri(self) -> str:
        return str(self.root)

    def uri(self, key: str) -> str:
        return str(self._path(key))

    def put_bytes(self, key: str, data: bytes) -> str:
        return self._put(key, data)

    def put_file(self, key: str, source: Path | str) -> str:
        """Copy the file ``source`` to ``key`` atomically (in chunks, never whole in memory)."""
        with Path(source).open("rb") as stream:
            return self.put_stream(key, stream)

    def put_stream(self, key: str, stream: BinaryIO) -> str:
        """Copy what is left in ``stream`` to ``key`` atomically, in chunks."""
        return self._put(key, source=stream)

    def create_bytes(self, key: str, data: bytes) -> str:
        path = self._path(key)
        temp = self._write_temp(path, data)
        try:
            # link() fails if the name exists, atomically: exactly one concurrent creator wins, and
            # the winner's bytes are complete before its name appears.
            os.link(temp, path)
        except FileExistsError as exc:
            raise ObjectExists(
                f"{path} already exists; conditional create refused to overwrite it (another writer won)",
                uri=str(path),
            ) from exc
        except OSError as exc:
            raise _storage_error(exc, "create", path) from exc
        finally:
            _unlink_quietly(temp)
        _fsync_dir(path.parent)
        return str(path)

    def get_versioned(self, key: str) -> tuple[bytes, str]:
        """The object's bytes and their SHA-256, the version :meth:`put_bytes_if` compares."""
        data = self.get_bytes(key)
        return data, sha256_hex(data)

    def put_bytes_if(self, key: str, data: bytes, version: str | None) -> str:
        """Replace the object with ``data`` only if its bytes still hash to ``version`` (``None``:
        only if there is none), else raise ``ObjectChanged``.

        The compare and the rename happen under an exclusive ``flock`` on the object's directory,
        which every ``put_bytes_if`` there takes (across threads and processes: each call opens its
        own descriptor), so two read-modify-writes cannot both land. The bytes are staged first, so
        the lock is held for one small read and a rename.
        """
        path = self._path(key)
        temp = self._write_temp(path, data)
        try:
            with _locked(path.parent):
                try:
                    current: str | None = sha256_hex(self.get_bytes(key))
                except ObjectNotFound:
                    current = None
                if current != version:
                    if current is None:
                        state = "is missing"
                    elif version is None:
                        state = "exists"
                    else:
                        state = "was replaced"
                    raise ObjectChanged(
                        f"{path} {state} since it was read; read it again and retry the change",
                        uri=str(path),
                    )
                os.replace(temp, path)
        except OSError as exc:
            raise _storage_error(exc, "write", path) from exc
        finally:
            _unlink_quietly(temp)
        _fsync_dir(path.parent)
        return str(path)

    def get_bytes(self, key: str) -> bytes:
        with self.open_read(key) as stream:
            return stream.read()

    def read_range(self, key: str, start: int, end: int) -> bytes:
        path = self._path(key)
        validate_range(start, end, uri=str(path))
        with self._open(path) as stream:
            if start == end:
                return b""
            stream.seek(start)
            return stream.read(end - start)

    def open_read(self, key: str) -> BinaryIO:
        return self._open(self._path(key))

    def size(self, key: str) -> int:
        return int(self._stat(key).st_size)

    def version(self, key: str) -> tuple[object, ...]:
        """Size, inode, mtime and ctime: a rewrite that sets the mtime back (``touch -r``,
        ``rsync --times``) still moves the ctime, which only the kernel sets."""
        st = self._stat(key)
        return (st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns)

    def _stat(self, key: str) -> os.stat_result:
        path = self._path(key)
        try:
            if path.is_file():
                return path.stat()
        except OSError as exc:
            raise _storage_error(exc, "stat", path) from exc
        raise _not_found(path)

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            path.unlink()
        except FileNotFoundError:
            return
        except OSError as exc:
            raise _storage_error(exc, "delete", path) from exc

    def list_keys(self, prefix: str = "") -> Iterator[str]:
        validate_prefix(prefix, base_uri=self.base_uri)
        directory = prefix.rpartition("/")[0]
        top = self.root.joinpath(*directory.split("/")) if directory else self.root
        keys: list[str] = []
        for current, dirnames, filenames in os.walk(top):
            dirnames.sort()
            relative = Path(current).relative_to(self.root).as_posix()
            for name in filenames:
                if is_temp_name(name):
                    continue
                key = name if relative == "." else f"{relative}/{name}"
                if key.startswith(prefix):
                    keys.append(key)
        yield from sorted(keys)

    def _path(self, key: str) -> Path:
        validate_key(key, base_uri=self.base_uri)
        return self.root.joinpath(*key.split("/"))

    def _open(self, path: Path) -> BinaryIO:
        try:
            if path.is_dir():
                raise _not_found(path)
            # O_NONBLOCK: opening a FIFO for reading would otherwise block until a writer comes
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError as exc:
            raise _not_found(path) from exc
        except OSError as exc:
            raise _storage_error(exc, "read", path) from exc
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ConfigurationError(
                    f"{path} is not a regular file (a FIFO, device or socket): give a file's path",
                    uri=str(path),
                )
            os.set_blocking(fd, True)
            return os.fdopen(fd, "rb")
        except BaseException:
            os.close(fd)
            raise

    def _put(self, key: str, data: bytes = b"", *, source: BinaryIO | None = None) -> str:
        """Write ``data`` (or what is left in ``source``) to a temporary file and move it onto
        ``key`` in one atomic step, replacing any existing object; return its path."""
        path = self._path(key)
        temp = self._write_temp(path, data, source=source)
        try:
            os.replace(temp, path)
        except OSError as exc:
            raise _storage_error(exc, "write", path) from exc
        finally:
            _unlink_quietly(temp)
        _fsync_dir(path.parent)
        return str(path)

    def _write_temp(self, path: Path, data: bytes = b"", *, source: BinaryIO | None = None) -> Path:
        """Write ``data`` (or what is left in ``source``) to a fresh, fsynced temporary file next to
        ``path``; return its path."""
        temp = path.with_name(f".{path.name}.{uuid.uuid4().hex}{TEMP_SUFFIX}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError as exc:
            raise _storage_error(exc, "write", path) from exc
        try:
            with os.fdopen(fd, "wb") as stream:
                if source is None:
                    stream.write(data)
                else:
                    shutil.copyfileobj(source, stream, CHUNK_SIZE)
                stream.flush()
                os.fsync(stream.fileno())
        except OSError as exc:
            _unlink_quietly(temp)
            raise _storage_error(exc, "write", path) from exc
        except BaseException:
            _unlink_quietly(temp)
            raise
        return temp


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``directory`` for the block (released by the kernel if the process dies)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _fsync_dir(directory: Path) -> None:
    """Persist a directory entry change; best effort where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quietly(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def _not_found(path: Path) -> ObjectNotFound:
    return ObjectNotFound(f"{path} does not exist; check the path", uri=str(path))


def _storage_error(exc: OSError, action: str, path: Path) -> StorageError:
    reason = exc.strerror or type(exc).__name__
    if exc.errno in (errno.EACCES, errno.EPERM):
        fix = "check the file permissions"
    elif exc.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = "free disk space"
    elif exc.errno in (errno.ENOTDIR, errno.EISDIR, errno.EEXIST):
        fix = "a file and a folder clash on this path; choose another output location"
    else:
        fix = "check the path"
    return StorageError(f"cannot {action} {path}: {reason}; {fix}", uri=str(path))
