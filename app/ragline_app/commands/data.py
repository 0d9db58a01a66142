"""`ragline data`: the evaluation data sets the measuring tools read."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    data = sub.add_parser(
        "data", help="the evaluation data sets the measuring tools read (list, fetch)"
    )
    data.add_argument("action", choices=("list", "fetch"))
    data.add_argument(
        "names",
        nargs="*",
        help="data sets (default: SQuAD dev, new_wiki, Wikipedia leads; `ragline data list`)",
    )
    data.add_argument("--into", help="folder (default RAGLINE_EVAL_DATA_DIR or <cache>/data)")
    data.set_defaults(func=cmd_data)


def cmd_data(args: argparse.Namespace) -> int:
    from ragline_app.eval_data import DATA_SETS, DEFAULT_SETS, DataError, data_dir, eval_file, fetch

    if args.action == "list":
        for name, data_set in DATA_SETS.items():
            path = eval_file(name)
            where = str(path) if path.exists() else "-"
            print(f"{name:<26} {data_set.licence:<13} {where}")
            print(f"{'':<26} {data_set.what} (from {data_set.archive.filename})")
        print(f"(`ragline data fetch` writes to {data_dir()}; RAGLINE_EVAL_DATA_DIR moves it)")
        return 0
    into = Path(args.into) if args.into else data_dir()
    try:
        fetch(args.names or list(DEFAULT_SETS), into)
    except DataError as error:
        print(f"ragline data fetch: {error}", file=sys.stderr)
        return 1
    return 0
