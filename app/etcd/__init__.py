"""etcd's v3 API in front of a metakv node (docs/etcd.md): gRPC (grpc_server.py) mapped onto
the service interface (app/service.py) by mapping.py, the one place etcd's rules live."""
