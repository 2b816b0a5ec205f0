from tests.cluster import cluster_factory  # noqa: F401
from tests.http.conftest import anyio_backend, client, service  # noqa: F401
