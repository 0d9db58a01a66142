"""A TCP proxy on loopback, in its own thread, that a test can turn slow or unreachable:
for what a service does when its store (etcd, Redis) answers late or not at all, while the
store itself keeps running.

Modes (switch at any time; connections already open follow the new mode):
- `pass`: bytes flow both ways;
- `delay`: every chunk, each way, waits `delay_s` before it is forwarded;
- `blackhole`: connections are accepted and bytes are read but nothing is forwarded, in
  either direction (a peer that hangs: the caller sees no reset, only silence).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading


class TcpProxy:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.mode = "pass"
        self.delay_s = 0.0
        self._flowing: asyncio.Event | None = None  # set unless blackholed (proxy's loop)
        self.connections = 0  # accepted since the start
        self.chunks_received = 0  # client -> proxy, forwarded or not
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None
        self._streams: set[asyncio.StreamWriter] = set()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def endpoint(self) -> str:  # as EtcdServer names it, for a proxy in front of one
        return self.address

    def start(self) -> TcpProxy:
        self._thread.start()
        self.port = self._call(self._start())
        return self

    def stop(self) -> None:
        self._call(self._stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def set(self, mode: str, delay_s: float = 0.0) -> None:
        assert mode in ("pass", "delay", "blackhole"), mode
        self.delay_s = delay_s
        self.mode = mode
        self._loop.call_soon_threadsafe(self._flow, mode != "blackhole")

    def _flow(self, flowing: bool) -> None:
        assert self._flowing is not None
        if flowing:
            self._flowing.set()
        else:
            self._flowing.clear()

    def _call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(10)

    async def _start(self) -> int:
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self._server.sockets[0].getsockname()[1]

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for stream in list(self._streams):
            stream.close()

    async def _serve(self, reader, writer) -> None:
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            writer.close()
            return
        self._streams.update((writer, up_writer))

        async def pump(source, sink, upstream: bool):
            while chunk := await source.read(65536):
                if upstream:
                    self.chunks_received += 1
                await self._flowing.wait()
                if self.mode == "delay":
                    await asyncio.sleep(self.delay_s)
                sink.write(chunk)
                await sink.drain()

        tasks = [
            asyncio.ensure_future(pump(reader, up_writer, True)),
            asyncio.ensure_future(pump(up_reader, writer, False)),
        ]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            task.cancel()
        for stream in (writer, up_writer):
            self._streams.discard(stream)
            with contextlib.suppress(Exception):
                stream.close()
