"""Input channels: check where each channel's data lives and lay it out under ``input/data/<name>``.

A channel's URI is a local path, a ``file://`` URI or an ``s3://`` URI, as SageMaker's ``fit``
accepts. It is read as a directory (every file under it, recursively) or as a single file. With
``ShardedByS3Key`` each host gets a disjoint share of the files, as SageMaker gives each instance
about 1/N of the objects; with ``FullyReplicated`` every host gets all of them.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
from collections.abc import Callable, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

import fsspec.core
from fsspec import AbstractFileSystem
from fsspec.callbacks import Callback

from dtrain.errors import ConfigError, DtrainError, UnknownKeyError, did_you_mean
from dtrain.jobs.spec import SHARDING_TYPES, ChannelSpec

# SageMaker's ChannelName: 1-64 of these characters. Names made only of dots are refused too:
# the name becomes a directory under input/data, and "." or ".." would escape it.
CHANNEL_NAME_PATTERN = re.compile(r"^(?!\.+$)[A-Za-z0-9.\-_]{1,64}$")
CHANNEL_ARG_FORMAT = "NAME=URI[,distribution=FullyReplicated|ShardedByS3Key][,content_type=TYPE]"
_CHANNEL_OPTIONS = ("content_type", "distribution")
_OPTION = re.compile(r"^([A-Za-z_]+)=(.*)$")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
_URI_FORMS = "a local path, file://PATH or s3://BUCKET/PREFIX"


def parse_channel_arg(text: str) -> ChannelSpec:
    """A ``--channel`` flag value as a checked :class:`ChannelSpec`.

    Syntax: ``NAME=URI[,distribution=FullyReplicated|ShardedByS3Key][,content_type=TYPE]``, e.g.
    ``train=s3://bucket/train,distribution=ShardedByS3Key``. Options are read from the end, so a
    URI may itself contain commas, unless a comma is followed by ``word=`` (read as an option).
    """
    name, separator, uri = text.partition("=")
    if not separator or not name or not uri:
        raise ConfigError("--channel", text, CHANNEL_ARG_FORMAT)
    options: dict[str, str] = {}
    while "," in uri:
        head, _, tail = uri.rpartition(",")
        match = _OPTION.match(tail)
        if match is None:
            break
        key, value = match.groups()
        if key not in _CHANNEL_OPTIONS:
            raise UnknownKeyError(f"--channel {name}", key, _CHANNEL_OPTIONS)
        if key in options:
            raise ConfigError(f"--channel {name}", text, f"{key} given at most once")
        options[key] = value
        uri = head
    channel = ChannelSpec(name, uri, **options)
    validate_channel(channel)
    return channel


def validate_channel(channel: ChannelSpec) -> None:
    """Refuse a channel that could not be laid out, before launch; local paths must exist."""
    if not isinstance(channel.name, str) or not CHANNEL_NAME_PATTERN.match(channel.name):
        raise ConfigError(
            "channel name",
            channel.name,
            "1-64 letters, digits, '.', '-' or '_' (not only dots)",
        )
    key = f"channels.{channel.name}"
    if channel.distribution not in SHARDING_TYPES:
        raise ConfigError(
            f"{key}.distribution",
            channel.distribution,
            ", ".join(SHARDING_TYPES),
            did_you_mean(str(channel.distribution), SHARDING_TYPES),
        )
    if channel.input_mode != "File":
        raise ConfigError(
            f"{key}.input_mode", channel.input_mode, "'File' (Pipe/FastFile unsupported)"
        )
    if channel.content_type is not None and not isinstance(channel.content_type, str):
        raise ConfigError(f"{key}.content_type", channel.content_type, "a MIME type string or None")
    if not isinstance(channel.uri, str) or not channel.uri:
        raise ConfigError(f"{key}.uri", channel.uri, _URI_FORMS)
    scheme = _scheme(channel.uri)
    if scheme == "s3":
        if not channel.uri.removeprefix("s3://").split("/", 1)[0]:
            raise ConfigError(f"{key}.uri", channel.uri, f"{_URI_FORMS} (a bucket is required)")
    elif scheme in ("", "file"):
        if not _local_path(channel.uri).exists():
            raise ConfigError(f"{key}.uri", channel.uri, "an existing local file or directory")
    else:
        raise ConfigError(f"{key}.uri", channel.uri, _URI_FORMS)


def validate_channels(channels: Sequence[ChannelSpec]) -> None:
    """Every channel valid and no name used twice (each name is one ``input/data`` directory);
    every file of a local channel one the hosts can copy."""
    seen: set[str] = set()
    for channel in channels:
        validate_channel(channel)
        if channel.name in seen:
            raise ConfigError("channel name", channel.name, "each channel name at most once")
        seen.add(channel.name)
        if _scheme(channel.uri) != "s3":
            _check_local_files(channel)


def _check_local_files(channel: ChannelSpec) -> None:
    """Refuse, before launch, a local channel that lists no file, or a file a host could not
    copy: a dangling link or an unreadable file would fail the copy, a fifo or device hang it."""
    key = f"channels.{channel.name}.uri"
    allowed = "a readable file, or a folder of readable files and links to them"
    try:
        _, sources = _channel_files(channel)
    except DtrainError as error:
        raise ConfigError(key, channel.uri, f"{allowed} ({error})") from None
    for path in sources.values():
        problem = _copy_problem(path)
        if problem:
            raise ConfigError(key, channel.uri, f"{allowed}; {path} is {problem}")


def _copy_problem(path: str) -> str | None:
    """What keeps the local file ``path`` from being copied into a channel, if anything."""
    try:
        mode = os.stat(path).st_mode
    except OSError as error:
        return "a link to nothing" if os.path.islink(path) else f"unreadable ({error.strerror})"
    if stat.S_ISDIR(mode):
        return "a link to a folder (links to folders are not followed)"
    if not stat.S_ISREG(mode):
        return "a special file (a fifo, socket or device)"
    if not os.access(path, os.R_OK):
        return "not readable"
    return None


def list_channel_files(channel: ChannelSpec) -> list[str]:
    """Sorted keys of the channel's files, relative to its URI (a file URI gives its own name).

    For ``s3://`` the endpoint comes from ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` when set,
    so MinIO, moto or any S3-compatible store works.
    """
    _, sources = _channel_files(channel)
    return sorted(sources)


def shard_files(
    files: Sequence[str], host_index: int, num_hosts: int, distribution: str = "ShardedByS3Key"
) -> list[str]:
    """The files one host gets: all of them, or with ``ShardedByS3Key`` every N-th sorted key.

    Round-robin over sorted keys makes the shares deterministic, disjoint and together complete;
    with more hosts than files some hosts get none.
    """
    if not 0 <= host_index < num_hosts:
        raise ValueError(f"host_index {host_index} outside 0..{num_hosts - 1}")
    ordered = sorted(files)
    if distribution == "FullyReplicated":
        return ordered
    if distribution == "ShardedByS3Key":
        return ordered[host_index::num_hosts]
    raise ConfigError("distribution", distribution, ", ".join(SHARDING_TYPES))


def materialize_channel(
    channel: ChannelSpec,
    dest_dir: Path,
    host_index: int,
    num_hosts: int,
    copied: Callable[[int, int | None, bool], None] = lambda done, total, final: None,
) -> list[Path]:
    """Fill ``dest_dir`` (a host's ``input/data/<name>``) with that host's files; return them.

    ``copied(done, total, final)`` hears the bytes copied so far as they grow, of ``total``
    (``None`` for S3, whose sizes would cost a request each), and once more with ``final`` at
    the end.

    Relative paths under the URI are kept. Every file is a copy (local files copied, remote ones
    downloaded), as SageMaker's File mode hands out copies: a job can write into its channel
    folder without changing its inputs. A key that would land outside ``dest_dir`` (``..``, an
    absolute key: possible in S3) fails the channel before anything is written.
    """
    fs, sources = _channel_files(channel)
    keys = shard_files(list(sources), host_index, num_hosts, channel.distribution)
    remote = _scheme(channel.uri) == "s3"
    for key in keys:
        _check_key(channel, key)
        problem = None if remote else _copy_problem(sources[key])
        if problem:
            raise DtrainError(f"channel {channel.name}: {sources[key]} is {problem}")
    dest_dir.mkdir(parents=True, exist_ok=True)
    targets = [dest_dir / key for key in keys]
    for target in targets:
        target.parent.mkdir(parents=True, exist_ok=True)
    paths = [sources[key] for key in keys]
    sizes = [] if remote else [os.path.getsize(path) for path in paths]
    total = None if remote else sum(sizes)
    done = 0

    def add(size: int) -> None:
        nonlocal done
        done += size
        copied(done, total, False)

    if keys and remote:
        try:
            fs.get(paths, [str(target) for target in targets], callback=_Download(add))
        except OSError as error:
            raise DtrainError(
                f"channel {channel.name}: cannot download {channel.uri}: {error}"
            ) from error
    else:
        for path, target, size in zip(paths, targets, sizes, strict=True):
            try:
                shutil.copyfile(path, target)
            except OSError as error:
                raise DtrainError(f"channel {channel.name}: cannot copy {path}: {error}") from None
            add(size)
    copied(done, done, True)
    return targets


class _Download(Callback):
    """fsspec's report of a many-file download, as bytes: each file's transfer (a branch) adds
    what it moves to ``add``; the download's own count (files done) is left out."""

    def __init__(self, add: Callable[[int], None]) -> None:
        super().__init__()
        self._add = add

    def branched(self, path_1: str, path_2: str, **kwargs: Any) -> Callback:
        return _FileBytes(self._add)


class _FileBytes(Callback):
    def __init__(self, add: Callable[[int], None]) -> None:
        super().__init__()
        self._add = add

    def relative_update(self, inc: int = 1) -> None:
        self._add(inc)


def _check_key(channel: ChannelSpec, key: str) -> None:
    parts = PurePosixPath(key).parts
    if not parts or key.startswith("/") or any(part in ("", ".", "..") for part in parts):
        raise DtrainError(
            f"channel {channel.name}: object key {key!r} under {channel.uri} would be written "
            "outside the channel folder; refusing the channel"
        )


def input_data_config(channels: Sequence[ChannelSpec]) -> dict[str, dict[str, str]]:
    """``inputdataconfig.json``: what SageMaker tells the container about each channel."""
    config: dict[str, dict[str, str]] = {}
    for channel in channels:
        entry = {
            "TrainingInputMode": "File",
            "S3DistributionType": channel.distribution,
            "RecordWrapperType": "None",
        }
        if channel.content_type:
            entry["ContentType"] = channel.content_type
        config[channel.name] = entry
    return config


def _scheme(uri: str) -> str:
    match = _SCHEME.match(uri)
    return match.group(1) if match else ""


def _local_path(uri: str) -> Path:
    return Path(uri.removeprefix("file://")).expanduser()


def _channel_files(channel: ChannelSpec) -> tuple[AbstractFileSystem, dict[str, str]]:
    """The channel's filesystem and its files: relative key -> path on that filesystem."""
    fs, root = _filesystem(channel.uri)
    try:
        if fs.isfile(root):
            return fs, {PurePosixPath(root).name: root}
        if not fs.isdir(root):
            local = _scheme(channel.uri) != "s3" and os.path.lexists(root)
            what = f"is {_copy_problem(root)}" if local else "does not exist"
            raise DtrainError(f"channel {channel.name}: {channel.uri} {what}")
        # Keys ending in "/" are the S3 console's empty "folder" markers, not files. A local
        # folder that cannot be listed is an error, not a silent gap in the data.
        listing = fs.find(root) if _scheme(channel.uri) == "s3" else fs.find(root, on_error="raise")
        found = [path for path in listing if not path.endswith("/")]
    except OSError as error:
        raise DtrainError(f"channel {channel.name}: cannot list {channel.uri}: {error}") from error
    if not found:
        raise DtrainError(f"channel {channel.name}: no files under {channel.uri}")
    return fs, {str(PurePosixPath(path).relative_to(root)): path for path in found}


def _filesystem(uri: str) -> tuple[AbstractFileSystem, str]:
    """The fsspec filesystem and root path of a URI.

    Local paths skip URL parsing (a path may contain ``::``). S3 filesystems are built fresh (no
    instance or listing cache), so a long-lived process sees objects uploaded since its last job;
    the endpoint is passed explicitly because older botocore releases ignore ``AWS_ENDPOINT_URL*``.
    """
    if _scheme(uri) != "s3":
        return fsspec.filesystem("file"), os.path.abspath(_local_path(uri))
    options: dict[str, Any] = {"skip_instance_cache": True, "use_listings_cache": False}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        options["client_kwargs"] = {"endpoint_url": endpoint}
    return fsspec.core.url_to_fs(uri, **options)
