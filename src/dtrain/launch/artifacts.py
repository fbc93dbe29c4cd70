"""Model and output artifacts.

Pack every host's ``model/`` and ``output/data`` like SageMaker and put them in the output path.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

import fsspec
from fsspec.implementations.local import LocalFileSystem
from tqdm.utils import CallbackIOWrapper

from dtrain.errors import ConfigError
from dtrain.jobs.folder import default_output_dir, make_private_dirs
from dtrain.progress import byte_bar

OUTPUT_SCHEMES = ("file", "s3")


def resolve_output_path(output_path: str | None, key: str = "output_path") -> str:
    """The output path (the value of ``key``) as a URL.

    Default ``file://$DTRAIN_HOME/output`` (SageMaker's is an S3 bucket).
    """
    if not output_path:
        return default_output_dir().as_uri()
    if "://" not in output_path:
        return Path(output_path).expanduser().resolve().as_uri()
    scheme = output_path.split("://", 1)[0]
    if scheme not in OUTPUT_SCHEMES:
        raise ConfigError(key, output_path, "a local path, a file:// URL or an s3:// URL")
    return output_path.rstrip("/")


@contextlib.contextmanager
def _write_whole(url: str) -> Iterator[IO[bytes]]:
    """A file that appears at ``url`` whole when the block ends, or not at all.

    Locally it is written beside its final name and renamed into place; on S3 the object exists
    only once its upload completes, and an interrupted one is discarded.
    """
    fs, path = fsspec.core.url_to_fs(url)
    if isinstance(fs, LocalFileSystem):  # private to the user, whatever the umask
        make_private_dirs(Path(path).parent)
        partial = Path(f"{path}.partial-{os.getpid()}")
        try:
            descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(descriptor, "wb") as handle:
                yield handle
            os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)
        return
    fs.makedirs(posixpath.dirname(path), exist_ok=True)
    handle = fs.open(path, "wb")
    try:
        yield handle
    except BaseException:
        handle.discard()
        raise
    handle.close()


def upload_artifacts(
    job_name: str,
    output_url: str,
    collect: Callable[[str, tarfile.TarFile], None],
    console: IO[str] | None = None,
) -> str:
    """Write ``<output>/<job>/output/{model,output}.tar.gz``; returns the model artifact URL.

    ``collect(stream, tar)`` adds every host's ``model/`` (stream ``model``) or ``output/data``
    (stream ``output``) to ``tar`` as they arrive: nothing is staged on disk. Each archive's
    bytes, as written, show on a bar where ``console`` is a terminal.
    """
    prefix = f"{output_url}/{job_name}/output"
    for stream in ("model", "output"):
        with (
            _write_whole(f"{prefix}/{stream}.tar.gz") as handle,
            byte_bar(f"{stream}.tar.gz", None, console) as bar,
            tarfile.open(
                fileobj=CallbackIOWrapper(bar.update, handle, "write"), mode="w|gz"
            ) as tar,
        ):
            collect(stream, tar)
    return f"{prefix}/model.tar.gz"
