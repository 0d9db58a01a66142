"""A TCP proxy in front of an HTTP server that can make one kind of request fail: for
tests of what a service does when its engine refuses a call (here llama-server's slot
erase) while everything else still works."""

from __future__ import annotations

import asyncio
import contextlib


class FaultyProxy:
    def __init__(self, upstream_port: int, failing: bytes) -> None:
        self.upstream_port = upstream_port
        self.failing = failing  # a request whose first line contains this is refused
        self.fail = False
        self.refused = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader, writer) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)

        async def client_to_upstream():
            while chunk := await reader.read(65536):
                # A request starts a chunk on a keep-alive connection (httpx writes each
                # request whole): look at its first line.
                if self.fail and self.failing in chunk.split(b"\r\n", 1)[0]:
                    self.refused += 1
                    writer.write(
                        b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\n"
                        b"Connection: close\r\n\r\n"
                    )
                    await writer.drain()
                    break
                up_writer.write(chunk)
                await up_writer.drain()

        async def upstream_to_client():
            while chunk := await up_reader.read(65536):
                writer.write(chunk)
                await writer.drain()

        tasks = [
            asyncio.ensure_future(client_to_upstream()),
            asyncio.ensure_future(upstream_to_client()),
        ]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            task.cancel()
        for stream in (writer, up_writer):
            with contextlib.suppress(Exception):
                stream.close()
