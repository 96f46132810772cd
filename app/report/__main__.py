"""``python -m app.report <sweep folder | run folder>``: (re)build the report at any time."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from app.report import NotAReportFolder, write_report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.report", description=__doc__)
    parser.add_argument("folder", type=Path, help="a multirun sweep folder or one run folder")
    args = parser.parse_args(argv)
    try:
        written = write_report(args.folder)
    except NotAReportFolder as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
