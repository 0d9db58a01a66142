"""`ragline doctor`: what this machine lacks for `make up` or `make test`, and what to do."""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    doctor = sub.add_parser(
        "doctor", help="check what the stack needs on this machine, with what to do for each"
    )
    doctor.add_argument(
        "--for",
        dest="purpose",
        choices=("up", "test"),
        default="up",
        help="up: what `ragline up` needs (default); test: also what `make test` needs",
    )
    doctor.add_argument(
        "--base-port", type=int, default=None, help="the ports `ragline up` will take (0: free)"
    )
    doctor.add_argument("--host", default="127.0.0.1")
    doctor.set_defaults(func=cmd_doctor)


def cmd_doctor(args: argparse.Namespace) -> int:
    from ragline_app.doctor import FAIL, Options, render, run_checks

    findings = run_checks(Options(args.purpose, args.base_port, args.host))
    print(render(findings))
    failed = [f.check for f in findings if f.state == FAIL]
    if failed:
        print(f"ragline doctor: fix {', '.join(failed)} first (advice above)", file=sys.stderr)
        return 1
    return 0
