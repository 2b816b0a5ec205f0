"""A TCP fault proxy per directed raft link, so chaos tests can break the network without
root, namespaces or iptables.

Each node dials its peers through its own outbound proxies: node A's connection to B goes
A -> proxy(A->B) -> B, and B's answers come back the same way. A proxy has two directions:
``forward`` (bytes A sends to B: A's requests) and ``backward`` (B's replies to A). Each
direction is in one of these modes:

- ``pass``: bytes flow (after ``delay_ms``, order kept);
- ``cut``: bytes are discarded. A TCP stream that lost bytes cannot be resumed without
  corrupting framing, so when a cut direction is healed every connection that lost bytes is
  reset, as a real partition long enough to time connections out would do;
- ``stall``: bytes are held (up to ``max_stalled_bytes`` per connection, then the proxy stops
  reading, so TCP backpressure builds) and delivered in order on heal: a paused network
  that finally delivers old messages.

``reset()`` aborts every open connection at once (RST). All of it runs on one asyncio loop;
``ProxyNetwork`` owns that loop on a background thread and offers plain method calls, so
a synchronous harness controls the faults.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, Literal

from raft.types import check

Mode = Literal["pass", "cut", "stall"]
Direction = Literal["forward", "backward", "both"]

# Bytes read from a socket per call.
READ_CHUNK_BYTES = 64 * 1024
# Per connection and direction, how many bytes a stall may hold before reading stops.
MAX_STALLED_BYTES = 8 * 1024 * 1024
# Delayed chunks waiting for delivery per connection and direction.
MAX_DELAYED_CHUNKS = 10_000
# How long connecting to the real peer may take.
CONNECT_TIMEOUT_S = 5.0


@dataclass(slots=True)
class DirectionState:
    """The fault applied to one direction of a link."""

    mode: Mode = "pass"
    delay_ms: int = 0
    changed: asyncio.Event | None = None  # set whenever mode or delay changes


@dataclass(slots=True, eq=False)
class _Connection:
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter | None = None
    lost_bytes: bool = False
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def abort(self) -> None:
        for writer in (self.client, self.upstream):
            if writer is None:
                continue
            sock = writer.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
        for task in self.tasks:
            task.cancel()


class LinkProxy:
    """One directed link: listens on 127.0.0.1 (a free port) and forwards to the target."""

    def __init__(self, name: str, target_host: str, target_port: int) -> None:
        self.name = name
        self.target_host = target_host
        self.target_port = target_port
        self.forward = DirectionState()
        self.backward = DirectionState()
        self._server: asyncio.base_events.Server | None = None
        self._connections: set[_Connection] = set()
        self.port = 0
        self.accepted_connections = 0
        self.forwarded_bytes = {"forward": 0, "backward": 0}
        self.discarded_bytes = {"forward": 0, "backward": 0}

    async def start(self) -> int:
        self.forward.changed = asyncio.Event()
        self.backward.changed = asyncio.Event()
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        self.reset()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)

    # -- control (call on the proxy's loop) -------------------------------------------

    def set_mode(self, direction: Direction, mode: Mode, delay_ms: int | None = None) -> None:
        check(mode in ("pass", "cut", "stall"), f"unknown mode {mode!r}")
        states = self._states(direction)
        healing_cut = mode != "cut" and any(state.mode == "cut" for state in states)
        for state in states:
            state.mode = mode
            if delay_ms is not None:
                check(delay_ms >= 0, "delay_ms must not be negative")
                state.delay_ms = delay_ms
            if state.changed is not None:
                state.changed.set()
        if healing_cut:
            for connection in [c for c in self._connections if c.lost_bytes]:
                self._drop(connection)

    def heal(self) -> None:
        """Back to plain forwarding both ways, no delay."""
        self.set_mode("both", "pass", delay_ms=0)

    def reset(self) -> None:
        """Abort every open connection (the peers see a reset and reconnect)."""
        for connection in list(self._connections):
            self._drop(connection)

    def _states(self, direction: Direction) -> list[DirectionState]:
        if direction == "forward":
            return [self.forward]
        if direction == "backward":
            return [self.backward]
        return [self.forward, self.backward]

    def _drop(self, connection: _Connection) -> None:
        connection.abort()
        self._connections.discard(connection)

    # -- data path --------------------------------------------------------------------

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted_connections += 1
        connection = _Connection(writer)
        self._connections.add(connection)
        try:
            upstream_reader, upstream_writer = await asyncio.wait_for(
                asyncio.open_connection(self.target_host, self.target_port), CONNECT_TIMEOUT_S)
        except (TimeoutError, OSError):
            self._drop(connection)
            return
        if connection not in self._connections:  # reset while connecting
            upstream_writer.transport.abort()
            return
        connection.upstream = upstream_writer
        forward = asyncio.create_task(self._pump(connection, reader, upstream_writer, self.forward, "forward"))
        backward = asyncio.create_task(self._pump(connection, upstream_reader, writer, self.backward, "backward"))
        connection.tasks = [forward, backward]
        await asyncio.wait(connection.tasks, return_when=asyncio.FIRST_COMPLETED)
        self._drop(connection)

    async def _pump(self, connection: _Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    state: DirectionState, direction: str) -> None:
        """Copy one direction, applying its fault; returns when either side closes."""
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue(MAX_DELAYED_CHUNKS)
        deliver = asyncio.create_task(self._deliver(connection, queue, writer, state, direction))
        loop = asyncio.get_running_loop()
        try:
            while True:
                try:
                    chunk = await reader.read(READ_CHUNK_BYTES)
                except (ConnectionError, OSError):
                    break
                if not chunk:
                    break
                if state.mode == "cut":
                    connection.lost_bytes = True
                    self.discarded_bytes[direction] += len(chunk)
                    continue
                await queue.put((loop.time() + state.delay_ms / 1000, chunk))
                # a stall holds bytes in the queue; the bound below makes TCP push back
                while queue.qsize() * READ_CHUNK_BYTES > MAX_STALLED_BYTES:
                    await asyncio.sleep(0.01)
            await queue.put(None)
            await deliver
        finally:
            deliver.cancel()

    async def _deliver(self, connection: _Connection, queue: asyncio.Queue[tuple[float, bytes] | None], writer: asyncio.StreamWriter,
                       state: DirectionState, direction: str) -> None:
        loop = asyncio.get_running_loop()
        while True:
            item = await queue.get()
            if item is None:
                with contextlib.suppress(OSError, RuntimeError):
                    writer.write_eof()
                return
            due, chunk = item
            while state.mode != "pass" or loop.time() < due:
                if state.mode == "cut":
                    connection.lost_bytes = True
                    self.discarded_bytes[direction] += len(chunk)
                    chunk = b""
                    break
                changed = state.changed
                check(changed is not None, "proxy used before start()")
                changed.clear()  # type: ignore[union-attr]
                timeout = None if state.mode == "stall" else max(0.0, due - loop.time())
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(changed.wait(), timeout)  # type: ignore[union-attr]
            if not chunk:
                continue
            try:
                writer.write(chunk)
                await writer.drain()
            except (ConnectionError, OSError, RuntimeError):
                return
            self.forwarded_bytes[direction] += len(chunk)


class ProxyNetwork:
    """Proxies for every directed link of a cluster, on a loop in a background thread.

    ``add_link(src, dst, host, port)`` returns the local port node ``src`` must dial to
    reach ``dst``. Every control method is synchronous and thread-safe.
    """

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="chaos-proxies", daemon=True)
        self._thread.start()
        self.links: dict[tuple[int, int], LinkProxy] = {}

    def _run(self, coroutine: Coroutine[Any, Any, Any], timeout_s: float = 10.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout_s)

    def _call(self, function: Any, *args: Any, **kwargs: Any) -> Any:
        async def invoke() -> Any:
            return function(*args, **kwargs)

        return self._run(invoke())

    def add_link(self, src: int, dst: int, target_host: str, target_port: int) -> int:
        proxy = LinkProxy(f"{src}->{dst}", target_host, target_port)
        port = self._run(proxy.start())
        self.links[(src, dst)] = proxy
        return port

    def link(self, src: int, dst: int) -> LinkProxy:
        return self.links[(src, dst)]

    def set_mode(self, src: int, dst: int, direction: Direction, mode: Mode, delay_ms: int | None = None) -> None:
        self._call(self.links[(src, dst)].set_mode, direction, mode, delay_ms)

    def cut_one_way(self, src: int, dst: int) -> None:
        """Messages from ``src`` no longer reach ``dst``; ``dst`` still reaches ``src``.
        src's requests to dst vanish, and dst's replies to src's own requests vanish too."""
        self.set_mode(src, dst, "forward", "cut")
        if (dst, src) in self.links:
            self.set_mode(dst, src, "backward", "cut")

    def cut_both_ways(self, a: int, b: int) -> None:
        for src, dst in ((a, b), (b, a)):
            if (src, dst) in self.links:
                self.set_mode(src, dst, "both", "cut")

    def partition(self, groups: list[set[int]]) -> None:
        """Cut every link between nodes of different groups (nodes in no group: untouched)."""
        group_of = {node: index for index, group in enumerate(groups) for node in group}
        for (src, dst) in self.links:
            if src in group_of and dst in group_of and group_of[src] != group_of[dst]:
                self.set_mode(src, dst, "both", "cut")

    def delay(self, src: int, dst: int, delay_ms: int) -> None:
        self.set_mode(src, dst, "both", "pass", delay_ms)

    def stall(self, src: int, dst: int) -> None:
        self.set_mode(src, dst, "both", "stall")

    def reset(self, src: int, dst: int) -> None:
        self._call(self.links[(src, dst)].reset)

    def reset_node(self, node: int) -> None:
        """Reset every connection to or from ``node``."""
        for (src, dst), proxy in self.links.items():
            if node in (src, dst):
                self._call(proxy.reset)

    def heal(self) -> None:
        for proxy in self.links.values():
            self._call(proxy.heal)

    def describe(self) -> dict[str, str]:
        """Each link's current faults, for logs and reports."""
        return {
            proxy.name: f"forward={proxy.forward.mode}/{proxy.forward.delay_ms}ms "
                        f"backward={proxy.backward.mode}/{proxy.backward.delay_ms}ms"
            for proxy in self.links.values()
        }

    def close(self) -> None:
        for proxy in self.links.values():
            with contextlib.suppress(Exception):
                self._run(proxy.stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)
        if not self._thread.is_alive():
            self._loop.close()
