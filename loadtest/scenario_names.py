"""Scenario names and their Locust user classes, importable without importing Locust
(importing Locust monkey-patches the process for gevent, which the runner must not be)."""

SCENARIOS: dict[str, str] = {
    "read_heavy": "ReadHeavy",
    "write_heavy": "WriteHeavy",
    "churn": "Churn",
    "hot_keys": "HotKeys",
    "cas_contention": "CasContention",
    "watchers": "Watchers",
    "large_values": "LargeValues",
    "list_prefix": "ListPrefix",
}
