"""``python -m pipeline JOB --input ... --output ... [--master URL]``

Exit codes: 0 done, 1 audit found a divergence, 2 bad input or bad flags (one line on
stderr, nothing at --output).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from pipeline.errors import EXIT_BAD_INPUT, PipelineInputError, input_error_message

JOBS = ("materialize", "audit", "churn", "loadtest")


class _OneLineParser(argparse.ArgumentParser):
    """Bad flags: one line and exit 2, as every metakv command line does."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"pipeline: error: {message}\n")
        raise SystemExit(EXIT_BAD_INPUT)


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is negative")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not positive")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="python -m pipeline", description="PySpark jobs over metakv data")
    parser.add_argument("job", choices=JOBS)
    parser.add_argument("--input", nargs="+", action="extend", required=True,
                        help="node data dirs, or dirs holding them (loadtest: result folders or their parent)")
    parser.add_argument("--output", required=True, help="directory to create with the results")
    parser.add_argument("--master", default=None, help="Spark master URL (default local[*])")
    parser.add_argument("--skip-corrupt", action="store_true",
                        help="skip corrupt or truncated batches (and count them) instead of failing")
    parser.add_argument("--version", type=_non_negative, default=None,
                        help="materialize: version to materialize; audit: committed version (default: read "
                             "from state.db / snapshots)")
    parser.add_argument("--node", default=None, help="materialize: which node when the input holds several")
    parser.add_argument("--window-ms", type=_positive, default=60_000, help="churn: time window")
    parser.add_argument("--prefix-depth", type=_positive, default=1,
                        help="churn: how many '/'-separated key components make the prefix")
    parser.add_argument("--split-bytes", type=_positive, default=None,
                        help="log jobs: byte range one task decodes (default: from the input size and the "
                             "cluster's cores, at most 16 MiB)")
    parser.add_argument("--shuffle-partitions", type=_positive, default=None)
    parser.add_argument("--show-ui", action="store_true", help="enable the Spark UI")
    parser.add_argument("--show-progress", action="store_true", help="show Spark's console progress bar")
    return parser


def _job(name: str) -> Callable[..., int]:
    if name == "materialize":
        from pipeline.jobs import run_materialize
        return run_materialize
    if name == "audit":
        from pipeline.jobs import run_audit
        return run_audit
    if name == "churn":
        from pipeline.churn import run_churn
        return run_churn
    from pipeline.loadtest import run_loadtest
    return run_loadtest


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from pipeline.fs import HadoopFS, StagedOutput
    from pipeline.session import (
        DEFAULT_MASTER,
        SMALL_INPUT_SHUFFLE_PARTITIONS,
        SparkSettings,
        build_session,
    )

    settings = SparkSettings(
        master=args.master or DEFAULT_MASTER, app_name=f"metakv-pipeline-{args.job}",
        shuffle_partitions=args.shuffle_partitions or SMALL_INPUT_SHUFFLE_PARTITIONS,
        show_ui=args.show_ui, show_progress=args.show_progress)
    spark = build_session(settings)
    fs = HadoopFS(spark)
    output = StagedOutput(fs, args.output)
    busy = output.check_target_free()
    if busy:
        sys.stderr.write(f"pipeline: error: {busy}\n")
        return EXIT_BAD_INPUT
    try:
        code = _job(args.job)(args, spark, fs, output)
    except Exception as error:
        output.abort()
        message = input_error_message(error)
        if message is None:
            raise
        sys.stderr.write(f"pipeline: error: {message}\n")
        return EXIT_BAD_INPUT
    output.commit()
    print(f"pipeline: wrote {output.target_uri}")
    return code


if __name__ == "__main__":
    try:
        sys.exit(main())
    except PipelineInputError as error:  # raised before a session existed
        sys.stderr.write(f"pipeline: error: {error.message}\n")
        sys.exit(EXIT_BAD_INPUT)
