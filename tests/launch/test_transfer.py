"""Folders as tar streams: code to the hosts, results back, nothing leaving its folder."""

from __future__ import annotations

import io
import socket
import tarfile
import threading
from pathlib import Path

import pytest

from dtrain.launch.transfer import (
    ChunkReader,
    Streams,
    TransferStalled,
    repack,
    safe_member_name,
    send_folder,
    unpack,
    unpack_files,
)
from dtrain.launch.wire import FROM_AGENT, FROM_CONTROLLER, Connection, ProtocolError


def stream_of(folder: Path, skip=lambda path: False) -> ChunkReader:
    """``folder`` sent over a socket pair, received into a reader as the controller does."""
    left, right = socket.socketpair()
    sender, receiver = Connection(left, FROM_CONTROLLER), Connection(right, FROM_AGENT)
    reader = ChunkReader()

    def receive() -> None:
        while True:
            message = receiver.receive()
            reader.feed(message.payload if message.kind == "chunk" else b"")
            if message.kind == "end":
                return

    thread = threading.Thread(target=receive)
    thread.start()
    send_folder(sender, "model", folder, skip)
    thread.join()
    return reader


def test_a_folder_arrives_whole_and_first_host_wins(tmp_path: Path) -> None:
    first, second = tmp_path / "one", tmp_path / "two"
    (first / "sub").mkdir(parents=True)
    (first / "model.pt").write_bytes(b"first" * 500_000)  # several chunks
    (first / "sub" / "a.txt").write_text("a")
    second.mkdir()
    (second / "model.pt").write_text("second")
    (second / "only-two.txt").write_text("2")
    buffer = io.BytesIO()
    seen: set[str] = set()
    with tarfile.open(fileobj=buffer, mode="w|gz") as tar:
        for folder in (first, second):
            reader = stream_of(folder)
            repack(reader, tar, seen)
            reader.drain()
    buffer.seek(0)
    with tarfile.open(fileobj=buffer) as tar:
        names = sorted(tar.getnames())
        model = tar.extractfile("model.pt").read()  # type: ignore[union-attr]
    assert names == ["model.pt", "only-two.txt", "sub/a.txt"]
    assert model == b"first" * 500_000


def test_code_unpacks_with_skips_and_refuses_links_out(tmp_path: Path) -> None:
    source = tmp_path / "src"
    (source / "__pycache__").mkdir(parents=True)
    (source / "__pycache__" / "x.pyc").write_text("")
    (source / "train.py").write_text("print(1)")
    (source / "local-link").symlink_to("train.py")
    target = tmp_path / "code"
    target.mkdir()
    unpack(stream_of(source, lambda path: path.name == "__pycache__"), target)
    assert sorted(p.name for p in target.iterdir()) == ["local-link", "train.py"]
    assert (target / "local-link").read_text() == "print(1)"
    (source / "escape").symlink_to("/etc/passwd")
    with pytest.raises(tarfile.TarError):
        unpack(stream_of(source), tmp_path / "code2")


@pytest.mark.parametrize("name", ["/etc/passwd", "../x", "a/../../x", "..", "a\0b"])
def test_member_names_that_leave_the_folder_are_refused(name: str) -> None:
    with pytest.raises(ProtocolError):
        safe_member_name(name)


def test_a_reader_fails_with_its_sender() -> None:
    reader = ChunkReader()
    reader.feed(b"abc")
    reader.fail(ProtocolError("gone"))
    assert reader.read(10) == b"abc"
    with pytest.raises(ProtocolError):
        reader.read(10)


def test_setuid_setgid_and_sticky_bits_do_not_survive_a_transfer(tmp_path: Path) -> None:
    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w") as tar:
        member = tarfile.TarInfo("tool")
        member.mode, member.size = 0o7755, 4
        tar.addfile(member, io.BytesIO(b"#!/x"))

    def stream() -> ChunkReader:
        reader = ChunkReader()
        reader.feed(archive.getvalue())
        reader.feed(b"")
        return reader

    repacked = io.BytesIO()
    with tarfile.open(fileobj=repacked, mode="w") as tar:
        repack(stream(), tar, set())
    repacked.seek(0)
    with tarfile.open(fileobj=repacked) as tar:
        assert tar.getmember("tool").mode == 0o755
    unpack(stream(), tmp_path)
    assert (tmp_path / "tool").stat().st_mode & 0o7777 == 0o755


def test_a_stream_given_up_midway_is_read_to_its_end_and_the_next_starts_in_step() -> None:
    """What a failed TensorBoard copy left in flight never reaches the model's reader."""
    streams = Streams()
    tensorboard = streams.open("tensorboard", lambda: None, stall_limit=60)
    arrived = threading.Event()

    def agent() -> None:  # sends far more than a reader holds: each feed waits for room
        for number in range(40):
            streams.route("tensorboard", bytes([number]) * 10)
        streams.route("tensorboard", b"")
        arrived.wait()
        streams.route("model", b"the model")
        streams.route("model", b"")

    sender = threading.Thread(target=agent)
    sender.start()
    assert tensorboard.read(10) == b"\0" * 10
    tensorboard.abandon()  # the copy failed here: 39 chunks and the end still to come
    with pytest.raises(ProtocolError, match="previous tensorboard stream is still arriving"):
        streams.open("tensorboard", lambda: None, stall_limit=60)
    model = streams.open("model", lambda: None, stall_limit=60)
    arrived.set()
    assert model.read() == b"the model"
    sender.join(timeout=10)
    assert not sender.is_alive()
    with pytest.raises(ProtocolError, match="sent 'model', which nobody asked for"):
        streams.route("model", b"more")


def test_a_stream_that_brings_nothing_fails_its_reader() -> None:
    reader = Streams().open("tensorboard", lambda: None, stall_limit=0.2)
    with pytest.raises(TransferStalled, match=r"^sent nothing of it for 0\.2 s$"):
        reader.read()


def test_only_regular_files_are_collected_and_every_link_is_named(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    (outside / "words").mkdir(parents=True)
    folder = tmp_path / "tensorboard"
    (folder / "run").mkdir(parents=True)
    (folder / "run" / "events").write_text("curves")
    (folder / "vocab").symlink_to(outside)  # a folder outside
    (folder / "latest").symlink_to("run/events")  # a file inside
    (folder / "gone").symlink_to(tmp_path / "nowhere")  # dangling
    said: list[tuple[str, str]] = []
    target = tmp_path / "collected"
    unpack_files(stream_of(folder), target, lambda name, kind: said.append((name, kind)))
    assert sorted(str(p.relative_to(target)) for p in target.rglob("*")) == ["run", "run/events"]
    assert said == [
        ("gone", f"a link to {str(tmp_path / 'nowhere')!r}"),
        ("latest", "a link to 'run/events'"),
        ("vocab", f"a link to {str(outside)!r}"),
    ]
    archive = io.BytesIO()
    said.clear()
    with tarfile.open(fileobj=archive, mode="w") as tar:
        repack(stream_of(folder), tar, set(), lambda name, kind: said.append((name, kind)))
    archive.seek(0)
    with tarfile.open(fileobj=archive) as tar:
        assert tar.getnames() == ["run/events"]
    assert [name for name, _ in said] == ["gone", "latest", "vocab"]
