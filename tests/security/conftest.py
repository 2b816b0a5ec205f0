from __future__ import annotations

from pathlib import Path

import pytest

from tests.cluster import cluster_factory  # noqa: F401
from tests.security.certs_fixture import CertSet, make_test_certs


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertSet:
    return make_test_certs(Path(tmp_path_factory.mktemp("certs")), range(1, 7), ("root", "stranger"))
