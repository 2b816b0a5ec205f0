"""Command line: `python -m loadtest run|report|bench` (see docs/loadtest.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NoReturn

from loadtest.clusters import CLUSTER_TARGETS, ClusterError
from loadtest.scenario_names import SCENARIOS


class _Parser(argparse.ArgumentParser):
    """Bad input: exit code 2 and one line saying what is wrong."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m loadtest", description="metakv load tests, side by side with etcd")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = commands.add_parser("run", help="run one scenario against a fresh cluster or a URL")
    run.add_argument("scenario", choices=sorted(SCENARIOS))
    run.add_argument("--target", default="metakv",
                     help="metakv, metakv-etcd (metakv through its etcd gateway) or etcd (a fresh local "
                          "3-node cluster), or comma-separated URLs")
    run.add_argument("--store", choices=["metakv", "etcd"], default=None,
                     help="API spoken by a URL target (default metakv)")
    run.add_argument("--users", type=int, default=8)
    run.add_argument("--rate", type=float, default=0.0,
                     help="task iterations per second over all users (0: as fast as answers come)")
    run.add_argument("--duration", type=float, default=20.0, help="seconds of load")
    run.add_argument("--churn", type=float, default=0.5, help="churn: share of creates + deletes (0..1)")
    run.add_argument("--seed", type=int, default=1)
    run.add_argument("--key-count", type=int, default=1000)
    run.add_argument("--failover-after", type=float, default=None,
                     help="SIGKILL the leader this many seconds after the load starts")
    run.add_argument("--out", type=Path, default=None, help="results folder (default results/<stamp>-...)")

    report = commands.add_parser("report", help="Markdown + HTML comparison of results folders")
    report.add_argument("results", nargs="+", type=Path, help="results folders, or folders holding them")
    report.add_argument("--out", type=Path, default=Path("results/report"))

    bench = commands.add_parser("bench", help="the standard metakv vs etcd comparison, then its report")
    bench.add_argument("--out", type=Path, default=None, help="default results/bench-<stamp>")
    bench.add_argument("--duration", type=float, default=10.0, help="seconds per run")
    bench.add_argument("--users", type=int, default=8)
    bench.add_argument("--targets", default="metakv,etcd",
                       help="a comma-separated subset of metakv,metakv-etcd,etcd")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "run":
            from loadtest.runner import RunSpec, run

            spec = RunSpec(
                scenario=args.scenario, target=args.target, store=args.store, users=args.users,
                rate=args.rate, duration_s=args.duration, churn=args.churn, seed=args.seed,
                key_count=args.key_count, failover_after_s=args.failover_after,
            )
            try:
                spec.validate()
            except ValueError as error:
                parser.error(str(error))
            out = run(spec, args.out)
            print(out)
            return 0
        if args.command == "report":
            from loadtest.report import write_report

            paths = write_report(args.results, args.out)
            for path in paths:
                print(path)
            return 0
        from loadtest.bench import BenchError, run_bench

        targets = [target.strip() for target in args.targets.split(",") if target.strip()]
        if not targets or any(target not in CLUSTER_TARGETS for target in targets):
            parser.error("--targets is a comma-separated subset of metakv,metakv-etcd,etcd")
        try:
            report_paths = run_bench(targets, args.duration, args.users, args.out)
        except BenchError as error:
            for path in error.paths:
                print(path)
            sys.stderr.write(f"python -m loadtest bench: {error}\n")
            return 1
        for path in report_paths:
            print(path)
        return 0
    except (ClusterError, FileNotFoundError) as error:
        sys.stderr.write(f"python -m loadtest: error: {error}\n")
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
