"""Folders as tar streams in messages: the job's code to each host, each host's results back.

A stream is a run of ``chunk`` messages of at most :data:`CHUNK` bytes and one ``end`` message, so a
folder of any size moves through a bounded buffer, and the receiver re-packs or unpacks members as
they arrive instead of staging a copy. Member names are checked on receipt: a peer cannot make a
name escape the folder it is written to.
"""

from __future__ import annotations

import io
import posixpath
import queue
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path

from dtrain.launch.wire import Connection, ProtocolError

CHUNK = 1 << 20


class _ChunkWriter(io.RawIOBase):
    """A write-only file whose bytes leave as ``chunk`` messages of :data:`CHUNK` bytes."""

    def __init__(self, send: Callable[[bytes], None]) -> None:
        self._send = send
        self._buffer = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, data: bytes) -> int:  # type: ignore[override]  # tarfile writes bytes
        self._buffer += data
        while len(self._buffer) >= CHUNK:
            self._send(bytes(self._buffer[:CHUNK]))
            del self._buffer[:CHUNK]
        return len(data)

    def flush_all(self) -> None:
        if self._buffer:
            self._send(bytes(self._buffer))
            self._buffer.clear()


def files_under(folder: Path, skip: Callable[[Path], bool] = lambda path: False) -> Iterator[Path]:
    """Regular files and links under ``folder``, sorted, not entering skipped or linked folders."""
    for path in sorted(folder.iterdir()):
        if skip(path):
            continue
        if path.is_dir() and not path.is_symlink():
            yield from files_under(path, skip)
        elif path.is_file() or path.is_symlink():
            yield path


def send_folder(
    connection: Connection,
    stream: str,
    folder: Path,
    skip: Callable[[Path], bool] = lambda path: False,
) -> None:
    """Send every file under ``folder`` (names relative to it) as the tar stream ``stream``."""
    writer = _ChunkWriter(lambda data: connection.send("chunk", data, stream=stream))
    with tarfile.open(fileobj=writer, mode="w|") as tar:
        if folder.is_dir():
            for path in files_under(folder, skip):
                tar.add(path, arcname=path.relative_to(folder).as_posix(), recursive=False)
    writer.flush_all()
    connection.send("end", stream=stream)


class ChunkReader(io.RawIOBase):
    """A read-only file fed with the chunks of one stream (``b""`` marks its end).

    The reader calls ``check`` before each chunk and every half second of waiting; it may raise
    to give up (a stop request).
    """

    def __init__(self, maxsize: int = 16, check: Callable[[], None] = lambda: None) -> None:
        self.chunks: queue.Queue[bytes | Exception] = queue.Queue(maxsize)
        self.check = check  # called while waiting: raises to give up (a stop request)
        self._current = b""
        self._ended = False

    def readable(self) -> bool:
        return True

    def feed(self, chunk: bytes) -> None:
        self.chunks.put(chunk)

    def fail(self, error: Exception) -> None:
        self.chunks.put(error)

    def drain(self) -> None:
        """Read to the end of the stream, so its sender can finish."""
        while self.read(CHUNK):
            pass

    def readinto(self, target: bytearray) -> int:  # type: ignore[override]  # read()'s bytearray
        while not self._current and not self._ended:
            self.check()
            try:
                item = self.chunks.get(timeout=0.5)
            except queue.Empty:
                continue
            if isinstance(item, Exception):
                raise item
            self._current = item
            self._ended = not item
        size = min(len(target), len(self._current))
        target[:size] = self._current[:size]
        self._current = self._current[size:]
        return size


def safe_member_name(name: str) -> str:
    """``name`` as a relative path that stays inside the folder it is written to."""
    normal = posixpath.normpath(name)
    if normal.startswith(("/", "../")) or normal in ("..", ".") or "\0" in normal:
        raise ProtocolError(f"archive member {name!r} would leave its folder")
    return normal


def repack(source: io.RawIOBase, target: tarfile.TarFile, seen: set[str]) -> None:
    """Copy the regular files of tar stream ``source`` into ``target``, but names in ``seen``,
    without setuid, setgid or sticky bits: whoever unpacks the archive gets no program that
    runs as someone else."""
    with tarfile.open(fileobj=source, mode="r|") as tar:
        for member in tar:
            if not member.isfile():
                continue
            name = safe_member_name(member.name)
            if name in seen:
                continue
            seen.add(name)
            member.name = name
            member.mode &= 0o777  # no setuid, setgid or sticky bit
            target.addfile(member, tar.extractfile(member))


def unpack(source: io.RawIOBase, folder: Path) -> None:
    """Extract the tar stream ``source`` into ``folder`` with tarfile's ``data`` filter.

    The filter refuses absolute names, ``..``, links that point out of ``folder`` and device
    files, and clears setuid, setgid and sticky bits and group and others' write bits.
    """
    with tarfile.open(fileobj=source, mode="r|") as tar:
        tar.extractall(folder, filter="data")
