"""Input channels: parsing, validation, listing, sharding and layout, locally and on S3 (moto)."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from dtrain.errors import ConfigError, DtrainError
from dtrain.jobs.channels import (
    input_data_config,
    list_channel_files,
    materialize_channel,
    parse_channel_arg,
    shard_files,
    validate_channels,
)
from dtrain.jobs.spec import ChannelSpec
from tests.conftest import S3_KEYS

FILES = ["a.csv", "b.csv", "nested/c.csv", "nested/deeper/d.csv", "e.csv"]


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    root = tmp_path / "data"
    for key in FILES:
        path = root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"content of {key}\n")
    return root


# --- parsing and validation -------------------------------------------------------------------


def test_parse_plain_local_path(dataset: Path) -> None:
    channel = parse_channel_arg(f"train={dataset}")
    assert channel == ChannelSpec("train", str(dataset))
    assert channel.distribution == "FullyReplicated"


def test_parse_options(dataset: Path) -> None:
    channel = parse_channel_arg(
        f"train.v2={dataset},distribution=ShardedByS3Key,content_type=text/csv"
    )
    assert channel == ChannelSpec("train.v2", str(dataset), "ShardedByS3Key", "text/csv")


def test_parse_keeps_commas_in_uri(tmp_path: Path) -> None:
    folder = tmp_path / "a,b"
    folder.mkdir()
    assert parse_channel_arg(f"x={folder}").uri == str(folder)


@pytest.mark.parametrize("text", ["train", "=/tmp", "train="])
def test_parse_malformed(text: str) -> None:
    with pytest.raises(ConfigError, match="NAME=URI"):
        parse_channel_arg(text)


def test_parse_unknown_option_suggests(dataset: Path) -> None:
    with pytest.raises(ConfigError, match="did you mean 'distribution'"):
        parse_channel_arg(f"train={dataset},distrbution=ShardedByS3Key")


@pytest.mark.parametrize("name", ["bad name", "a/b", "..", "x" * 65, "träin"])
def test_bad_channel_name(dataset: Path, name: str) -> None:
    with pytest.raises(ConfigError, match="channel name"):
        parse_channel_arg(f"{name}={dataset}")


def test_bad_scheme_names_channel_and_uri() -> None:
    with pytest.raises(ConfigError) as info:
        parse_channel_arg("train=gs://bucket/train")
    message = str(info.value)
    assert "channels.train.uri" in message
    assert "gs://bucket/train" in message
    assert "s3://" in message


def test_s3_needs_bucket() -> None:
    with pytest.raises(ConfigError, match="bucket"):
        parse_channel_arg("train=s3:///prefix")


@pytest.mark.parametrize("prefix", ["", "file://"])
def test_missing_local_path(tmp_path: Path, prefix: str) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError, match="existing local file or directory") as info:
        parse_channel_arg(f"train={prefix}{missing}")
    assert str(missing) in str(info.value)


def test_bad_distribution_suggests(dataset: Path) -> None:
    with pytest.raises(ConfigError) as info:
        parse_channel_arg(f"train={dataset},distribution=ShardedByKey")
    assert info.value.key == "channels.train.distribution"
    assert info.value.suggestion == "ShardedByS3Key"


def test_only_file_input_mode(dataset: Path) -> None:
    with pytest.raises(ConfigError, match="input_mode"):
        validate_channels([ChannelSpec("train", str(dataset), input_mode="Pipe")])


def test_duplicate_channel_names(dataset: Path) -> None:
    channel = ChannelSpec("train", str(dataset))
    with pytest.raises(ConfigError, match="at most once"):
        validate_channels([channel, channel])


ROOT = os.geteuid() == 0


@pytest.mark.parametrize(
    ("make", "problem"),
    [
        (lambda path: path.symlink_to(path.parent / "missing"), "a link to nothing"),
        (os.mkfifo, "a special file (a fifo, socket or device)"),
        (lambda path: path.symlink_to(path.parent / "nested"), "a link to a folder"),
        pytest.param(
            lambda path: path.touch(mode=0),
            "not readable",
            marks=pytest.mark.skipif(ROOT, reason="root reads every file"),
        ),
    ],
    ids=["dangling link", "fifo", "link to a folder", "unreadable"],
)
def test_a_local_file_a_host_could_not_copy_is_refused_before_launch_and_on_the_host(
    dataset: Path, tmp_path: Path, make: Callable[[Path], None], problem: str
) -> None:
    odd = dataset / "odd"
    make(odd)
    channel = ChannelSpec("train", str(dataset))
    expected = re.escape(f"; {odd} is {problem}")
    with pytest.raises(
        ConfigError, match=rf"^channels\.train\.uri: got .*readable files.*{expected}"
    ):
        validate_channels([channel])
    with pytest.raises(DtrainError, match=re.escape(f"channel train: {odd} is {problem}")):
        materialize_channel(channel, tmp_path / "dest", 0, 1)
    assert not (tmp_path / "dest").exists()


def test_an_empty_local_channel_is_refused_before_launch(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"channels\.empty\.uri: .*no files under"):
        validate_channels([ChannelSpec("empty", str(tmp_path))])


# --- listing ----------------------------------------------------------------------------------


def test_list_local_dir_recursive(dataset: Path) -> None:
    assert list_channel_files(ChannelSpec("train", str(dataset))) == sorted(FILES)


def test_list_single_file(dataset: Path) -> None:
    assert list_channel_files(ChannelSpec("train", str(dataset / "nested" / "c.csv"))) == ["c.csv"]


def test_list_file_uri(dataset: Path) -> None:
    channel = parse_channel_arg(f"train=file://{dataset}/nested/")
    assert list_channel_files(channel) == ["c.csv", "deeper/d.csv"]


def test_list_empty_dir(tmp_path: Path) -> None:
    with pytest.raises(DtrainError, match=re.escape(f"channel empty: no files under {tmp_path}")):
        list_channel_files(ChannelSpec("empty", str(tmp_path)))


def test_list_vanished_path(tmp_path: Path) -> None:
    with pytest.raises(DtrainError, match=r"channel gone: .* does not exist"):
        list_channel_files(ChannelSpec("gone", str(tmp_path / "gone")))


# --- sharding ---------------------------------------------------------------------------------


@pytest.mark.parametrize("num_hosts", [2, 3])
def test_sharded_by_key_is_disjoint_and_complete(num_hosts: int) -> None:
    files = [f"part-{i:03d}" for i in range(10)]
    shares = [shard_files(files[::-1], host, num_hosts) for host in range(num_hosts)]
    assert sorted(key for share in shares for key in share) == files
    assert sum(len(share) for share in shares) == len(files)
    assert all(abs(len(share) - len(files) / num_hosts) < 1 for share in shares)
    assert shares == [shard_files(files, host, num_hosts) for host in range(num_hosts)]


def test_fully_replicated_gives_every_host_all() -> None:
    files = ["b", "a", "c"]
    for host in range(3):
        assert shard_files(files, host, 3, "FullyReplicated") == ["a", "b", "c"]


def test_shard_rejects_bad_host_index() -> None:
    with pytest.raises(ValueError, match="host_index"):
        shard_files(["a"], 2, 2)


# --- materializing ----------------------------------------------------------------------------


def test_materialize_local_copies_keep_layout_and_protect_the_inputs(
    dataset: Path, tmp_path: Path
) -> None:
    dest = tmp_path / "opt" / "ml" / "input" / "data" / "train"
    written = materialize_channel(ChannelSpec("train", str(dataset)), dest, 0, 2)
    assert written == [dest / key for key in sorted(FILES)]
    for key in FILES:
        assert not (dest / key).is_symlink()
        assert (dest / key).read_text() == f"content of {key}\n"
        (dest / key).write_text("changed by the job")
        assert (dataset / key).read_text() == f"content of {key}\n"


def test_materialize_local_sharded(dataset: Path, tmp_path: Path) -> None:
    channel = ChannelSpec("train", str(dataset), "ShardedByS3Key")
    seen: list[str] = []
    for host in range(2):
        dest = tmp_path / f"algo-{host + 1}" / "train"
        written = materialize_channel(channel, dest, host, 2)
        seen += [path.relative_to(dest).as_posix() for path in written]
        assert sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()) == [
            path.relative_to(dest).as_posix() for path in written
        ]
    assert sorted(seen) == sorted(FILES)


def test_materialize_single_file(dataset: Path, tmp_path: Path) -> None:
    dest = tmp_path / "train"
    written = materialize_channel(ChannelSpec("train", f"file://{dataset}/a.csv"), dest, 0, 1)
    assert written == [dest / "a.csv"]
    assert written[0].read_text() == "content of a.csv\n"


def test_input_data_config() -> None:
    channels = [
        ChannelSpec("train", "s3://b/train", "ShardedByS3Key", "text/csv"),
        ChannelSpec("test", "/data/test"),
    ]
    assert input_data_config(channels) == {
        "train": {
            "TrainingInputMode": "File",
            "S3DistributionType": "ShardedByS3Key",
            "RecordWrapperType": "None",
            "ContentType": "text/csv",
        },
        "test": {
            "TrainingInputMode": "File",
            "S3DistributionType": "FullyReplicated",
            "RecordWrapperType": "None",
        },
    }


# --- S3, against a local moto server (never AWS): fixtures in conftest.py -----------------------


def test_s3_sharded_materialize(bucket: str, tmp_path: Path) -> None:
    channel = parse_channel_arg(f"train=s3://{bucket}/train/,distribution=ShardedByS3Key")
    expected = sorted(key.removeprefix("train/") for key in S3_KEYS)
    assert list_channel_files(channel) == expected
    seen: list[str] = []
    for host in range(2):
        dest = tmp_path / f"algo-{host + 1}" / "input" / "data" / "train"
        reports: list[tuple[int, int | None, bool]] = []
        written = materialize_channel(channel, dest, host, 2, lambda *r, to=reports: to.append(r))
        assert len(written) == 2
        size = sum(path.stat().st_size for path in written)  # counted as the bytes arrive
        assert reports[-1] == (size, size, True)
        assert [r[1] for r in reports[:-1]] == [None] * (len(reports) - 1)
        for path in written:
            key = path.relative_to(dest).as_posix()
            assert not path.is_symlink()
            assert path.read_text() == f"object train/{key}\n"
            seen.append(key)
    assert sorted(seen) == expected


def test_s3_single_object(bucket: str, tmp_path: Path) -> None:
    channel = parse_channel_arg(f"one=s3://{bucket}/train/part-1.csv")
    written = materialize_channel(channel, tmp_path / "one", 0, 1)
    assert written == [tmp_path / "one" / "part-1.csv"]
    assert written[0].read_text() == "object train/part-1.csv\n"


def test_s3_missing_prefix(bucket: str) -> None:
    with pytest.raises(
        DtrainError, match=re.escape(f"channel train: s3://{bucket}/missing does not exist")
    ):
        list_channel_files(parse_channel_arg(f"train=s3://{bucket}/missing"))


def test_s3_keys_that_would_leave_the_channel_folder_fail_it(
    s3_endpoint: str, tmp_path: Path
) -> None:
    import boto3

    client = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    client.create_bucket(Bucket="hostile")
    for key in ("train/ok.csv", "train/../../planted.py"):
        client.put_object(Bucket="hostile", Key=key, Body=b"x")
    dest = tmp_path / "job" / "hosts" / "algo-1" / "input" / "data" / "train"
    channel = parse_channel_arg("train=s3://hostile/train/")
    with pytest.raises(DtrainError, match=r"object key '../../planted.py' .* outside"):
        materialize_channel(channel, dest, 0, 1)
    assert [p for p in (tmp_path / "job").rglob("*") if p.is_file()] == []
    assert not (tmp_path / "job" / "hosts" / "planted.py").exists()
