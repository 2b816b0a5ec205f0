"""Running the CLI in-process (it reuses the session fixture's SparkSession) and reading back."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pandas as pd

from pipeline.__main__ import main


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:  # type: ignore[no-untyped-def]
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def parquet_rows(path: Path) -> pd.DataFrame:
    return pd.read_parquet(path)


def sqlite_entries(db_path: Path) -> list[tuple[str, bytes, str, int, int]]:
    connection = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        return connection.execute(
            "SELECT key, value, content_type, mod_version, create_version FROM entries ORDER BY key").fetchall()
    finally:
        connection.close()


def frame_entries(frame: pd.DataFrame) -> list[tuple[str, bytes, str, int, int]]:
    ordered = frame.sort_values("key")
    return [(r.key, bytes(r.value), r.content_type, int(r.mod_version), int(r.create_version))
            for r in ordered.itertuples()]
