"""etcd's v3 protocol messages and gRPC service stubs.

They come generated from etcd's published .proto files (package ``etcdserverpb``, field
numbers unchanged) in aetcd, a maintained Apache-2.0 etcd client on PyPI: one dependency
instead of vendored .proto files and a generation step. Everything of etcd's protocol is
imported from here, so changing where it comes from touches this module only.
"""

from __future__ import annotations

from aetcd.rpc import kv_pb2, rpc_pb2, rpc_pb2_grpc

__all__ = ["kv_pb2", "rpc_pb2", "rpc_pb2_grpc"]
