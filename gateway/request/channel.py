"""Messages between a serving process and its body lane (``body_lane``), both ends on an event loop.

A ``SOCK_SEQPACKET`` Unix socket pair: the kernel keeps each datagram whole, so a message (pickled) goes
in frames of at most ``FRAME`` bytes (a datagram must fit the socket's send buffer), each led by one
byte (``MORE`` or ``LAST``), and file descriptors (``SCM_RIGHTS``) ride with its first frame. A lock keeps
one message's frames together. Both ends are kvgate's own processes (the lane is the serving process's
child): pickle is safe here and nowhere else.
"""

from __future__ import annotations

import array
import asyncio
import pickle
import socket
from collections.abc import Callable, Sequence
from typing import Any

FRAME = 60 * 1024
MORE, LAST = b"+", b"."
MAX_FDS = 4  # descriptors one message may carry


class Channel:
    """One end: ``send`` a message; each message received goes to ``received(message, fds)`` (the fds
    are the receiver's to close), and ``closed()`` is called once when the other end is gone."""

    def __init__(
        self,
        sock: socket.socket,
        received: Callable[[Any, list[int]], None],
        closed: Callable[[], None],
    ) -> None:
        sock.setblocking(False)
        self.sock, self.received, self.closed = sock, received, closed
        self.loop = asyncio.get_running_loop()
        self.lock = asyncio.Lock()
        self.frames: list[bytes] = []
        self.fds: list[int] = []
        self.open = True
        self.loop.add_reader(sock.fileno(), self._readable)

    async def send(self, message: Any, fds: Sequence[int] = ()) -> None:
        """Send ``message`` (and duplicates of ``fds``: the caller still closes its own); raises
        ``ConnectionError`` if the other end is gone."""
        data = memoryview(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
        starts = range(0, max(len(data), 1), FRAME)
        async with self.lock:
            for start in starts:
                flag = LAST if start + FRAME >= len(data) else MORE
                ancillary = []
                if start == 0 and fds:
                    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                while True:
                    if not self.open:
                        raise ConnectionError("the other end of the channel is gone")
                    try:
                        self.sock.sendmsg([flag, data[start : start + FRAME]], ancillary)
                        break
                    except BlockingIOError:
                        await self._writable()

    async def _writable(self) -> None:
        ready = self.loop.create_future()
        fd = self.sock.fileno()
        self.loop.add_writer(fd, _settle, ready)
        try:
            await ready
        finally:
            self.loop.remove_writer(fd)

    def _readable(self) -> None:
        while self.open:
            try:
                data, ancillary, _, _ = self.sock.recvmsg(FRAME + 1, socket.CMSG_SPACE(MAX_FDS * 4))
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data, ancillary = b"", []
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    passed = array.array("i")
                    passed.frombytes(payload[: len(payload) - len(payload) % passed.itemsize])
                    self.fds.extend(passed)
            if not data:  # the other end closed
                self.close()
                self.closed()
                return
            self.frames.append(data[1:])
            if data[:1] == LAST:
                message = pickle.loads(b"".join(self.frames))
                fds, self.frames, self.fds = self.fds, [], []
                self.received(message, fds)

    def close(self) -> None:
        if self.open:
            self.open = False
            self.loop.remove_reader(self.sock.fileno())
            self.sock.close()


def _settle(ready: asyncio.Future[None]) -> None:
    if not ready.done():
        ready.set_result(None)
