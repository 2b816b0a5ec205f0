"""The bounds of the HTTP layer: the limits docs/api.md states, and the settings an
operator (or a test) may tighten."""

from __future__ import annotations

from dataclasses import dataclass

KEY_MAX_BYTES = 1024
MAX_VERSION = 2**63 - 1  # versions are SQLite INTEGERs
CONTENT_TYPE_MAX_BYTES = 256
DEFAULT_MAX_VALUE_BYTES = 1024 * 1024
DEFAULT_MAX_TXN_BODY_BYTES = 8 * 1024 * 1024  # JSON (and base64) overhead over a few values
TXN_MAX_OPS = 128  # per branch, and compares per txn
LIST_LIMIT_DEFAULT = 100
LIST_LIMIT_MAX = 1000
WATCH_EVENTS_MAX = 1000  # events per long-poll answer or per SSE read
DEFAULT_WAIT_MS = 5000
DEFAULT_WATCH_TIMEOUT_MS = 30_000
DEFAULT_MAX_HEADER_BYTES = 64 * 1024  # request line and headers (nginx allows 32 KiB, Node 16 KiB)
DEFAULT_HEADER_TIMEOUT_MS = 10_000  # from connect (or a request's first byte) to complete headers
DEFAULT_WRITE_STALL_TIMEOUT_MS = 30_000  # a client reading nothing this long is disconnected
DEFAULT_MAX_CONNECTIONS = 10_000  # HTTP connections per node (serve also keeps it below the fd limit)
DEFAULT_MAX_CONNECTIONS_PER_CLIENT = 1000  # HTTP connections per client address
DEFAULT_MAX_WATCHERS = 10_000  # open watches (long-polls and SSE streams) per node
DEFAULT_MAX_WATCHERS_PER_TOKEN = 1000  # per token (auth on) per node
# Values per list page or watch answer (SSE read): a page ends after the entry that reaches
# it, so 1,000 values of 1 MiB are never held (or rendered) at once.
DEFAULT_MAX_ANSWER_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class HttpSettings:
    """Bounds of the HTTP layer. Waits above the maxima are clamped, not refused, the way
    long-poll APIs (Consul's ``wait``) behave, so a client asking too much still gets an answer."""

    max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES
    max_txn_body_bytes: int = DEFAULT_MAX_TXN_BODY_BYTES
    max_wait_ms: int = 60_000  # min_version waits
    max_watch_timeout_ms: int = 300_000  # watch long-polls and SSE stream lifetime
    sse_keepalive_ms: int = 15_000  # comment lines that keep idle proxies from closing streams
    watch_events_max: int = WATCH_EVENTS_MAX  # events per long-poll answer or per SSE read
    max_watchers: int = DEFAULT_MAX_WATCHERS  # past it: 429 too-many-watchers
    max_watchers_per_token: int = DEFAULT_MAX_WATCHERS_PER_TOKEN
    max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES  # values per list page or watch answer

    def __post_init__(self) -> None:
        for name in ("max_value_bytes", "max_txn_body_bytes", "max_wait_ms", "max_watch_timeout_ms",
                     "max_watchers", "max_watchers_per_token"):
            if getattr(self, name) < 0:
                raise ValueError(f"HttpSettings.{name} must be >= 0")
        if self.max_answer_bytes <= 0:
            raise ValueError("HttpSettings.max_answer_bytes must be > 0")
        # A zero keepalive would make an idle SSE stream a busy loop.
        if self.sse_keepalive_ms <= 0:
            raise ValueError("HttpSettings.sse_keepalive_ms must be > 0")
        if not 0 < self.watch_events_max <= WATCH_EVENTS_MAX:
            raise ValueError(f"HttpSettings.watch_events_max must be in 1..{WATCH_EVENTS_MAX}")


def clamp_ms(value: int, maximum: int) -> int:
    return max(0, min(value, maximum))
