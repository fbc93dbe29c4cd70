"""Write this rank's report (its arguments, the launcher's variables, its folder) as
``report-rank<RANK>.json`` in its output data folder.

Run as a job's script it only reports: for tests of what a rank is given, without torch's import
(about 2 s of CPU a rank on the 2 test cores). ``collective.py`` reports with it too.
"""

import json
import os
import sys
from pathlib import Path

REPORTED = (
    "SM_", "OMPI_", "RANK", "WORLD", "LOCAL_", "MASTER_", "DTRAIN_", "GROUP_RANK",
    "CUDA_VISIBLE", "MY_FLAG", "LAUNCHER_",
)  # fmt: skip


def write_report(rank: int) -> None:
    report = {
        "rank": rank,
        "argv": sys.argv[1:],
        "env": {k: v for k, v in os.environ.items() if k.startswith(REPORTED)},
        "cwd": os.getcwd(),
    }
    out = Path(os.environ["SM_OUTPUT_DATA_DIR"]) / f"report-rank{rank}.json"
    out.write_text(json.dumps(report))


if __name__ == "__main__":
    write_report(int(os.environ["RANK"]))
