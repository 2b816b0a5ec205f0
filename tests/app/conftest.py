"""Fixtures for the cluster-level tests: real `metakv serve` processes on loopback."""

from tests.cluster import cluster_factory  # noqa: F401  (re-exported as a fixture)
