"""Fixtures for the lease client's tests: real `metakv serve` clusters on loopback."""

from tests.cluster import cluster_factory  # noqa: F401  (re-exported as a fixture)
