from tests.cluster import cluster_factory  # noqa: F401
