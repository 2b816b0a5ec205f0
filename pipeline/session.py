"""One place that builds the SparkSession, so every job runs offline and quietly.

Why each setting: executors must run the project's interpreter (they import storage/ to
decode batches), Spark must not try to resolve the machine's public address (loopback only
here), the UI and the console progress bar are noise for a CLI, and the default 200 shuffle
partitions make a small input spend its time scheduling empty tasks. Nothing here assumes
local mode: ``master`` is passed through untouched, and every file is read by Spark tasks.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pyspark.sql import SparkSession

DEFAULT_MASTER = "local[*]"
SMALL_INPUT_SHUFFLE_PARTITIONS = 4
LOG4J_CONFIG = Path(__file__).with_name("log4j2.properties")
SHIPPED_PACKAGES = ("raft", "storage", "pipeline")  # what executor tasks import


@dataclass(frozen=True, slots=True)
class SparkSettings:
    master: str = DEFAULT_MASTER
    app_name: str = "metakv-pipeline"
    shuffle_partitions: int = SMALL_INPUT_SHUFFLE_PARTITIONS
    show_ui: bool = False
    show_progress: bool = False
    driver_memory: str = "1g"


def spark_environment() -> None:
    """Environment the driver and the executors it launches must share."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")


def build_session(settings: SparkSettings) -> SparkSession:
    """Start (or reuse) the session; a reused session gets this run's shuffle partitions."""
    spark_environment()
    builder = (
        SparkSession.builder.master(settings.master)
        .appName(settings.app_name)
        .config("spark.ui.enabled", str(settings.show_ui).lower())
        .config("spark.ui.showConsoleProgress", str(settings.show_progress).lower())
        .config("spark.sql.shuffle.partitions", str(settings.shuffle_partitions))
        .config("spark.default.parallelism", str(max(settings.shuffle_partitions, 2)))
        .config("spark.driver.memory", settings.driver_memory)
        .config("spark.executorEnv.PYSPARK_PYTHON", os.environ["PYSPARK_PYTHON"])
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.parquet.outputTimestampType", "TIMESTAMP_MICROS")
        .config("spark.driver.extraJavaOptions", f"-Dlog4j2.configurationFile=file:{LOG4J_CONFIG}")
        .config("spark.executor.extraJavaOptions", f"-Dlog4j2.configurationFile=file:{LOG4J_CONFIG}")
    )
    if settings.master.startswith("local"):
        builder = builder.config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
    spark = builder.getOrCreate()
    spark.conf.set("spark.sql.shuffle.partitions", str(settings.shuffle_partitions))
    spark.sparkContext.setLogLevel("ERROR")
    if not settings.master.startswith("local"):
        ship_packages(spark)
    return spark


def ship_packages(spark: SparkSession) -> None:
    """On a cluster the executors may not have metakv installed: send our packages along."""
    root = Path(__file__).resolve().parent.parent
    staging = tempfile.mkdtemp(prefix="metakv-pyfiles-")
    for package in SHIPPED_PACKAGES:
        shutil.copytree(root / package, Path(staging) / package,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    archive_dir = tempfile.mkdtemp(prefix="metakv-pyzip-")
    archive = shutil.make_archive(os.path.join(archive_dir, "metakv"), "zip", staging)
    spark.sparkContext.addPyFile(archive)
