"""The replica's inter-deployment gRPC port goes on the node address, not every interface."""

import asyncio

import grpc
import psutil
import pytest
from ray.serve._private import replica

from k3ray.actors.serve.replica_grpc_bind import bind_replica_grpc_to


def listening_on(port: int) -> set[str]:
    return {c.laddr.ip for c in psutil.Process().net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


def test_serve_s_every_interface_address_is_bound_on_the_node_address(monkeypatch):
    serve_add_port = replica.add_port_to_grpc_server
    monkeypatch.setattr(replica, "add_port_to_grpc_server", serve_add_port)  # undone after the test

    async def bind(address: str) -> tuple[int, set[str]]:
        server = grpc.aio.server()
        port = replica.add_port_to_grpc_server(server, address)  # the call replica.py makes
        await server.start()
        try:
            return port, listening_on(port)
        finally:
            await server.stop(None)

    port, before = asyncio.run(bind("[::]:0"))
    assert port > 0 and before == {"::"}  # Serve's own binding: every interface
    bind_replica_grpc_to("127.0.0.1")
    bind_replica_grpc_to("127.0.0.1")  # again: still one rewrite over Serve's function
    assert replica.add_port_to_grpc_server.serve_add_port is serve_add_port
    port, after = asyncio.run(bind("[::]:0"))
    assert port > 0 and after and after <= {"127.0.0.1", "::ffff:127.0.0.1"}  # gRPC may take an IPv4-mapped socket
    with pytest.raises(ValueError, match="IP address"):
        bind_replica_grpc_to("")
