"""Model and output artifacts.

Pack ``model/`` and ``output/data`` like SageMaker and put them in the output path.
"""

from __future__ import annotations

import tarfile
import tempfile
from collections.abc import Sequence
from pathlib import Path

import fsspec

from dtrain.errors import ConfigError
from dtrain.jobs.folder import dtrain_home

OUTPUT_SCHEMES = ("file", "s3")


def resolve_output_path(output_path: str | None) -> str:
    """The output path as a URL.

    Default ``file://$DTRAIN_HOME/output`` (SageMaker's is an S3 bucket).
    """
    if not output_path:
        return (dtrain_home() / "output").as_uri()
    if "://" not in output_path:
        return Path(output_path).expanduser().resolve().as_uri()
    scheme = output_path.split("://", 1)[0]
    if scheme not in OUTPUT_SCHEMES:
        raise ConfigError("output_path", output_path, "a local path, a file:// URL or an s3:// URL")
    return output_path.rstrip("/")


def pack(directories: Sequence[Path], archive: Path) -> None:
    """One ``.tar.gz`` of the union of ``directories`` (the hosts' ``model/``).

    The first host wins.
    """
    seen: set[str] = set()
    with tarfile.open(archive, "w:gz") as tar:
        for directory in directories:
            for path in sorted(directory.rglob("*")):
                name = path.relative_to(directory).as_posix()
                if name in seen or path.is_dir():
                    continue
                seen.add(name)
                tar.add(path, arcname=name)


def upload_artifacts(
    job_name: str, output_url: str, model_dirs: Sequence[Path], output_data_dirs: Sequence[Path]
) -> str:
    """Write ``<output>/<job>/output/{model,output}.tar.gz``; returns the model artifact URL."""
    prefix = f"{output_url}/{job_name}/output"
    fs, root = fsspec.core.url_to_fs(prefix)
    fs.makedirs(root, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        for name, directories in (("model", model_dirs), ("output", output_data_dirs)):
            local = Path(scratch) / f"{name}.tar.gz"
            pack(directories, local)
            fs.put_file(str(local), f"{root}/{name}.tar.gz")
    return f"{prefix}/model.tar.gz"
