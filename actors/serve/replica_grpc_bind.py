"""Serve 2.60 binds each replica's inter-deployment gRPC server to every interface (`[::]:0` in
ray/serve/_private/replica.py); `bind_replica_grpc_to(host)` puts it on the node's own address,
the one callers dial (a replica's node IP and that port), so a local server listens on loopback only.
Called in the replica process before Serve starts that server (from the deployment's constructor)."""

from __future__ import annotations

from ray.serve._private import replica

EVERY_INTERFACE = "[::]:"


def bind_replica_grpc_to(host: str) -> None:
    """From now on in this process, Serve's replica gRPC port is bound on `host` (an IP address)."""
    if not host:
        raise ValueError("bind_replica_grpc_to needs the node's IP address")
    add_port = getattr(replica.add_port_to_grpc_server, "serve_add_port", replica.add_port_to_grpc_server)
    shown = f"[{host}]" if ":" in host else host

    def add_port_on_host(server, address: str) -> int:
        if address.startswith(EVERY_INTERFACE):
            address = f"{shown}:{address.removeprefix(EVERY_INTERFACE)}"
        return add_port(server, address)

    add_port_on_host.serve_add_port = add_port  # a second call rebinds from Serve's own function
    replica.add_port_to_grpc_server = add_port_on_host
