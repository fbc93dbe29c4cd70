"""Folders as tar streams in messages: the job's code to each host, each host's results back.

A stream is a run of ``chunk`` messages of at most :data:`CHUNK` bytes and one ``end`` message, so a
folder of any size moves through a bounded buffer, and the receiver re-packs or unpacks members as
they arrive instead of staging a copy. Member names are checked on receipt: a peer cannot make a
name escape the folder it is written to. Only regular files are collected from a host: a link (to
a folder, a file, nowhere) or any other kind of member is skipped, and said.

A receiver that gives up on a stream (a member it cannot write, a stop request) leaves the rest
of it to :class:`Streams`, which reads it to its end and drops it, so the next stream the peer
sends starts in step; a stream that makes no progress for :data:`~dtrain.launch.wire.SILENCE_LIMIT`
fails its reader.
"""

from __future__ import annotations

import io
import posixpath
import queue
import tarfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from dtrain.launch.wire import SILENCE_LIMIT, Connection, ConnectionClosed, ProtocolError

CHUNK = 1 << 20


class TransferStalled(ConnectionClosed):
    """A stream's sender sent nothing of it for too long."""


def _no_check() -> None:
    return None


class _ChunkWriter(io.RawIOBase):
    """A write-only file whose bytes leave as ``chunk`` messages of :data:`CHUNK` bytes;
    ``check`` is called before each and may raise to give up (a stop request)."""

    def __init__(self, send: Callable[[bytes], object], check: Callable[[], None]) -> None:
        self._send = send
        self._check = check
        self._buffer = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, data: bytes) -> int:  # type: ignore[override]  # tarfile writes bytes
        self._buffer += data
        while len(self._buffer) >= CHUNK:
            self._check()
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
    check: Callable[[], None] = _no_check,
) -> None:
    """Send every file under ``folder`` (names relative to it) as the tar stream ``stream``;
    ``check`` is called before each chunk and may raise to give up."""
    writer = _ChunkWriter(lambda data: connection.send("chunk", data, stream=stream), check)
    with tarfile.open(fileobj=writer, mode="w|") as tar:
        if folder.is_dir():
            for path in files_under(folder, skip):
                tar.add(path, arcname=path.relative_to(folder).as_posix(), recursive=False)
    writer.flush_all()
    connection.send("end", stream=stream)


class ChunkReader(io.RawIOBase):
    """A read-only file fed with the chunks of one stream (``b""`` marks its end).

    The reader calls ``check`` before each chunk and every half second of waiting; it may raise
    to give up (a stop request). Waiting fails once nothing came for ``stall_limit`` seconds
    since ``progress()`` (the last sign of the sender moving on: by default, this stream's last
    chunk).
    """

    def __init__(
        self,
        maxsize: int = 16,
        check: Callable[[], None] = _no_check,
        progress: Callable[[], float] | None = None,
        stall_limit: float = SILENCE_LIMIT,
    ) -> None:
        self.chunks: queue.Queue[bytes | Exception] = queue.Queue(maxsize)
        self.check = check  # called while waiting: raises to give up (a stop request)
        self.stall_limit = stall_limit
        self.last_chunk = time.monotonic()
        self._progress = progress or (lambda: self.last_chunk)
        self._current = b""
        self._ended = False
        self.abandoned = False

    def readable(self) -> bool:
        return True

    def feed(self, chunk: bytes) -> None:
        """Hand the reader ``chunk``; waits while it holds ``maxsize`` unread ones, unless
        it was abandoned (then the chunk is dropped)."""
        self.last_chunk = time.monotonic()
        if not self.abandoned:
            self.chunks.put(chunk)

    def fail(self, error: Exception) -> None:
        self.chunks.put(error)

    def abandon(self) -> None:
        """Nobody reads on: drop what waits and what comes (a feed waiting for room goes on)."""
        self.abandoned = True
        while True:
            try:
                self.chunks.get_nowait()
            except queue.Empty:
                return

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
                if time.monotonic() - self._progress() > self.stall_limit:
                    raise TransferStalled(
                        f"sent nothing of it for {self.stall_limit:g} s"
                    ) from None
                continue
            if isinstance(item, Exception):
                raise item
            self._current = item
            self._ended = not item
        size = min(len(target), len(self._current))
        target[:size] = self._current[:size]
        self._current = self._current[size:]
        return size


class Streams:
    """The tar streams a peer was asked for, by name, fed from the thread that reads the peer.

    A chunk goes to its stream's reader; one of a stream nobody asked for is the peer's breach of
    the protocol. A stream stays here until its end, even once its reader gave up
    (:meth:`ChunkReader.abandon`): the rest is dropped, so a failed collection never leaves the
    next stream reading another's bytes.
    """

    def __init__(self) -> None:
        self._readers: dict[str, ChunkReader] = {}
        self._lock = threading.Lock()
        self.last_progress = time.monotonic()
        """When the peer last sent a chunk of any stream: it is moving on."""

    def open(self, name: str, check: Callable[[], None], stall_limit: float) -> ChunkReader:
        """A reader for the stream ``name`` the peer is about to be asked for."""
        with self._lock:
            if name in self._readers:
                raise ProtocolError(f"its previous {name} stream is still arriving")
            self.last_progress = time.monotonic()
            reader = ChunkReader(
                check=check, progress=lambda: self.last_progress, stall_limit=stall_limit
            )
            self._readers[name] = reader
            return reader

    def route(self, name: str, chunk: bytes) -> None:
        """The peer sent ``chunk`` of stream ``name`` (``b""``: its end)."""
        with self._lock:
            reader = self._readers.get(name)
            if reader is None:
                raise ProtocolError(f"sent {name!r}, which nobody asked for")
            if not chunk:
                del self._readers[name]
            self.last_progress = time.monotonic()
        reader.feed(chunk)  # may wait for room: outside the lock, so close can abandon it

    def fail(self, error: Exception) -> None:
        """The peer is gone: every reader fails with ``error``."""
        with self._lock:
            readers = list(self._readers.values())
        for reader in readers:
            reader.fail(error)


def safe_member_name(name: str) -> str:
    """``name`` as a relative path that stays inside the folder it is written to."""
    normal = posixpath.normpath(name)
    if normal.startswith(("/", "../")) or normal in ("..", ".") or "\0" in normal:
        raise ProtocolError(f"archive member {name!r} would leave its folder")
    return normal


Skipped = Callable[[str, str], None]
"""Hears each member not collected: its name and what it is (``a link to 'x'``)."""


def _kind(member: tarfile.TarInfo) -> str:
    if member.issym():
        return f"a link to {member.linkname!r}"
    if member.islnk():
        return f"a hard link to {member.linkname!r}"
    if member.ischr() or member.isblk():
        return "a device file"
    if member.isfifo():
        return "a fifo"
    return "not a regular file"


def _regular_files(tar: tarfile.TarFile, skipped: Skipped) -> Iterator[tarfile.TarInfo]:
    """The regular files of ``tar`` as they arrive, named safely; folders are implied by their
    files, and every other member is skipped and said."""
    for member in tar:
        if member.isdir():
            continue
        name = safe_member_name(member.name)
        if not member.isreg():
            skipped(name, _kind(member))
            continue
        member.name = name
        yield member


def repack(
    source: io.RawIOBase,
    target: tarfile.TarFile,
    seen: set[str],
    skipped: Skipped = lambda name, kind: None,
) -> None:
    """Copy the regular files of tar stream ``source`` into ``target``, but names in ``seen``,
    without setuid, setgid or sticky bits: whoever unpacks the archive gets no program that
    runs as someone else."""
    with tarfile.open(fileobj=source, mode="r|") as tar:
        for member in _regular_files(tar, skipped):
            name = member.name
            if name in seen:
                continue
            seen.add(name)
            member.mode &= 0o777  # no setuid, setgid or sticky bit
            target.addfile(member, tar.extractfile(member))


def unpack_files(source: io.RawIOBase, folder: Path, skipped: Skipped) -> None:
    """Extract the regular files of tar stream ``source`` into ``folder`` (tarfile's ``data``
    filter), skipping and saying every other member."""
    with tarfile.open(fileobj=source, mode="r|") as tar:
        for member in _regular_files(tar, skipped):
            tar.extract(member, folder, filter="data")


def unpack(source: io.RawIOBase, folder: Path) -> None:
    """Extract the tar stream ``source`` into ``folder`` with tarfile's ``data`` filter.

    The filter refuses absolute names, ``..``, links that point out of ``folder`` and device
    files, and clears setuid, setgid and sticky bits and group and others' write bits.
    """
    with tarfile.open(fileobj=source, mode="r|") as tar:
        tar.extractall(folder, filter="data")
