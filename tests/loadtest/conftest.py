"""One cluster per store kind for the whole loadtest test session: the scenario tests share
it (each run writes under its own key prefix), which keeps the suite inside its budget.
A missing etcd binary is an error, not a skip: `make venv` installs it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from loadtest.clusters import LocalCluster, start_cluster


@pytest.fixture(scope="session")
def etcd_cluster() -> Iterator[LocalCluster]:
    cluster = start_cluster("etcd")
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def metakv_cluster() -> Iterator[LocalCluster]:
    cluster = start_cluster("metakv")
    try:
        yield cluster
    finally:
        cluster.stop()
