"""etcd's gRPC errors (status code and message, as etcd's api/v3rpc/rpctypes spells them)
and the mapping of the service's failures onto them, so etcd clients' error handling
(retry on UNAVAILABLE, ErrCompacted, ...) works unchanged."""

from __future__ import annotations

import grpc

from app import service


class EtcdError(Exception):
    """An answer etcd gives as a gRPC status: ``code`` and ``message``; the JSON gateway
    renders the same pair."""

    def __init__(self, code: grpc.StatusCode, message: str, compact_revision: int = 0) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.compact_revision = compact_revision  # for a compacted revision: the oldest readable


def compacted(oldest_version: int) -> EtcdError:
    return EtcdError(grpc.StatusCode.OUT_OF_RANGE, "etcdserver: mvcc: required revision has been compacted",
                     oldest_version)


FUTURE_REVISION = (grpc.StatusCode.OUT_OF_RANGE, "etcdserver: mvcc: required revision is a future revision")
EMPTY_KEY = (grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: key is not provided")
KEY_NOT_FOUND = (grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: key not found")
LEASE_NOT_FOUND = (grpc.StatusCode.NOT_FOUND, "etcdserver: requested lease not found")
LEASE_EXISTS = (grpc.StatusCode.FAILED_PRECONDITION, "etcdserver: lease already exists")
LEASE_TTL_TOO_LARGE = (grpc.StatusCode.OUT_OF_RANGE, "etcdserver: too large lease TTL")
LEASE_PROVIDED = (grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: lease is provided")
NO_LEADER = (grpc.StatusCode.UNAVAILABLE, "etcdserver: no leader")
TIMEOUT = (grpc.StatusCode.UNAVAILABLE, "etcdserver: request timed out")
LEADER_FAIL = (grpc.StatusCode.UNAVAILABLE,
               "etcdserver: request timed out, possibly due to previous leader failure")
TOO_LARGE = (grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: request is too large")
NO_SPACE = (grpc.StatusCode.RESOURCE_EXHAUSTED, "etcdserver: mvcc: database space exceeded")
NOT_CAPABLE = (grpc.StatusCode.UNAVAILABLE, "etcdserver: not capable")
UNHEALTHY = (grpc.StatusCode.UNAVAILABLE, "etcdserver: unhealthy cluster")
# auth (app/etcd/access.py)
PERMISSION_DENIED = (grpc.StatusCode.PERMISSION_DENIED, "etcdserver: permission denied")
INVALID_TOKEN = (grpc.StatusCode.UNAUTHENTICATED, "etcdserver: invalid auth token")
AUTH_FAILED = (grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: authentication failed, invalid user ID or password")
USER_EMPTY = (grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: user name is empty")
AUTH_NOT_ENABLED = (grpc.StatusCode.FAILED_PRECONDITION, "etcdserver: authentication is not enabled")


def etcd_error(pair: tuple[grpc.StatusCode, str]) -> EtcdError:
    return EtcdError(*pair)


def invalid(detail: str) -> EtcdError:
    """A request metakv cannot express (not one of etcd's own errors): says what and why."""
    return EtcdError(grpc.StatusCode.INVALID_ARGUMENT, f"metakv: {detail}")


def unimplemented(detail: str) -> EtcdError:
    return EtcdError(grpc.StatusCode.UNIMPLEMENTED, f"metakv: {detail}")


def from_service_error(exc: service.ServiceError) -> EtcdError:
    """The etcd answer for a failure of the service (app/service.py)."""
    if isinstance(exc, service.HistoryCompactedError):
        return compacted(exc.oldest_version)
    for kind, pair in _SERVICE_ERRORS:  # subclasses before their bases
        if isinstance(exc, kind):
            return etcd_error(pair)
    return EtcdError(grpc.StatusCode.UNAVAILABLE, f"metakv: {exc}")


_SERVICE_ERRORS: tuple[tuple[type[service.ServiceError], tuple[grpc.StatusCode, str]], ...] = (
    (service.VersionWaitTimeoutError, FUTURE_REVISION),
    (service.LeaseNotFoundError, LEASE_NOT_FOUND),
    (service.LeaseExistsError, LEASE_EXISTS),
    (service.LeaseTtlError, LEASE_TTL_TOO_LARGE),
    (service.NotLeaderError, NO_LEADER),
    (service.WriteTooLargeError, TOO_LARGE),
    (service.WriteRejectedError, TIMEOUT),
    (service.IndeterminateError, LEADER_FAIL),
    (service.QuotaExceededError, NO_SPACE),
    (service.NotReadyError, UNHEALTHY),
)
