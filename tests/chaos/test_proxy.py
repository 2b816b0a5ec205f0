"""The fault proxy against plain echo servers: each fault does what the harness relies on."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable

from tests.chaos.proxy import LinkProxy, ProxyNetwork

# Generous bound for anything that should happen; short window for what must not happen.
ARRIVE_TIMEOUT_S = 10.0
ABSENT_WINDOW_S = 0.3


class EchoServer:
    """Echoes every byte back and remembers what it received."""

    def __init__(self) -> None:
        self.received = bytearray()
        self.port = 0
        self._server: asyncio.base_events.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while chunk := await reader.read(65536):
                self.received += chunk
                writer.write(chunk)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()


def run(test: Callable[[LinkProxy, EchoServer], Awaitable[None]]) -> None:
    async def main() -> None:
        echo = EchoServer()
        await echo.start()
        proxy = LinkProxy("1->2", "127.0.0.1", echo.port)
        await proxy.start()
        try:
            await test(proxy, echo)
        finally:
            await proxy.stop()
            await echo.stop()

    asyncio.run(main())


async def connect(proxy: LinkProxy) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", proxy.port)


async def read_exactly(reader: asyncio.StreamReader, count: int) -> bytes:
    return await asyncio.wait_for(reader.readexactly(count), ARRIVE_TIMEOUT_S)


async def nothing_arrives(reader: asyncio.StreamReader) -> bool:
    try:
        data = await asyncio.wait_for(reader.read(1), ABSENT_WINDOW_S)
    except (TimeoutError, ConnectionResetError):
        return True
    return data == b""  # a closed connection delivered nothing either


async def is_closed(reader: asyncio.StreamReader) -> bool:
    """True when the peer closed or reset the connection without sending anything more."""
    try:
        data = await asyncio.wait_for(reader.read(100), ARRIVE_TIMEOUT_S)
    except ConnectionResetError:
        return True
    return data == b""


async def wait_until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + ARRIVE_TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def test_bytes_pass_both_ways_in_order() -> None:
    async def scenario(proxy: LinkProxy, echo: EchoServer) -> None:
        reader, writer = await connect(proxy)
        payload = bytes(range(256)) * 4000  # about 1 MB, many chunks
        writer.write(payload)
        await writer.drain()
        assert await read_exactly(reader, len(payload)) == payload
        assert bytes(echo.received) == payload
        writer.close()

    run(scenario)


def test_delay_holds_each_chunk_at_least_the_delay() -> None:
    async def scenario(proxy: LinkProxy, echo: EchoServer) -> None:
        proxy.set_mode("forward", "pass", delay_ms=200)
        reader, writer = await connect(proxy)
        started = time.monotonic()
        writer.write(b"ping")
        assert await read_exactly(reader, 4) == b"ping"
        assert time.monotonic() - started >= 0.2
        writer.close()

    run(scenario)


def test_forward_cut_discards_requests_and_heal_resets_the_connection() -> None:
    async def scenario(proxy: LinkProxy, echo: EchoServer) -> None:
        reader, writer = await connect(proxy)
        writer.write(b"before")
        assert await read_exactly(reader, 6) == b"before"
        proxy.set_mode("forward", "cut")
        writer.write(b"lost")
        await writer.drain()
        assert await nothing_arrives(reader)
        assert bytes(echo.received) == b"before"
        proxy.heal()
        # the stream lost bytes: it is reset rather than resumed mid-frame
        assert await is_closed(reader)
        reader2, writer2 = await connect(proxy)
        writer2.write(b"after")
        assert await read_exactly(reader2, 5) == b"after"
        writer2.close()

    run(scenario)


def test_backward_cut_lets_requests_through_but_drops_replies() -> None:
    async def scenario(proxy: LinkProxy, echo: EchoServer) -> None:
        proxy.set_mode("backward", "cut")
        reader, writer = await connect(proxy)
        writer.write(b"one-way")
        await writer.drain()
        await wait_until(lambda: bytes(echo.received) == b"one-way")
        assert await nothing_arrives(reader)
        assert proxy.discarded_bytes["backward"] == 7
        writer.close()

    run(scenario)


def test_stall_holds_bytes_and_delivers_them_in_order_on_heal() -> None:
    async def scenario(proxy: LinkProxy, echo: EchoServer) -> None:
        reader, writer = await connect(proxy)
        proxy.set_mode("forward", "stall")
        for index in range(50):
            writer.write(f"m{index:03d};".encode())
        await writer.drain()
        assert await nothing_arrives(reader)
        assert echo.received == b""
        proxy.heal()
        expected = b"".join(f"m{index:03d};".encode() for index in range(50))
        assert await read_exactly(reader, len(expected)) == expected
        writer.close()

    run(scenario)


def test_reset_aborts_open_connections() -> None:
    async def scenario(proxy: LinkProxy, echo: EchoServer) -> None:
        reader, writer = await connect(proxy)
        writer.write(b"x")
        assert await read_exactly(reader, 1) == b"x"
        proxy.reset()
        assert await is_closed(reader)
        reader2, writer2 = await connect(proxy)
        writer2.write(b"y")
        assert await read_exactly(reader2, 1) == b"y"
        writer2.close()

    run(scenario)


def test_unreachable_target_closes_the_client_connection() -> None:
    async def scenario(proxy: LinkProxy, echo: EchoServer) -> None:
        await echo.stop()
        await asyncio.sleep(0)
        proxy.target_port = _closed_port()
        reader, writer = await connect(proxy)
        assert await is_closed(reader)
        writer.close()

    run(scenario)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_proxy_network_partitions_and_heals_from_a_plain_thread() -> None:
    """The harness is synchronous: ProxyNetwork runs the proxies on its own loop."""
    servers: dict[int, socket.socket] = {}
    network = ProxyNetwork()
    try:
        for node in (1, 2, 3):
            server = socket.socket()
            server.bind(("127.0.0.1", 0))
            server.listen()
            servers[node] = server
        ports = {(src, dst): network.add_link(src, dst, "127.0.0.1", servers[dst].getsockname()[1])
                 for src in (1, 2, 3) for dst in (1, 2, 3) if src != dst}
        network.partition([{1}, {2, 3}])
        modes = network.describe()
        assert modes["1->2"].startswith("forward=cut") and modes["2->1"].startswith("forward=cut")
        assert modes["2->3"] == "forward=pass/0ms backward=pass/0ms"
        network.heal()
        assert all(mode == "forward=pass/0ms backward=pass/0ms" for mode in network.describe().values())
        network.cut_one_way(1, 2)
        assert network.link(1, 2).forward.mode == "cut" and network.link(1, 2).backward.mode == "pass"
        assert network.link(2, 1).backward.mode == "cut" and network.link(2, 1).forward.mode == "pass"
        network.heal()
        # a real byte round trip through a link from this thread
        client = socket.create_connection(("127.0.0.1", ports[(1, 2)]), timeout=ARRIVE_TIMEOUT_S)
        accepted, _ = servers[2].accept()
        client.sendall(b"hello")
        accepted.settimeout(ARRIVE_TIMEOUT_S)
        assert accepted.recv(5) == b"hello"
        client.close()
        accepted.close()
    finally:
        network.close()
        for server in servers.values():
            server.close()
