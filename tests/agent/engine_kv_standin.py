"""A STAND-IN for vLLM's ZMQ KV-event publisher (vllm/distributed/kv_events.py
`ZmqEventPublisher`; SGLang's is the same code), not the engine: the same sockets and frames
(a PUB sending `(topic, seq 8 bytes big-endian, payload)`, a ROUTER answering a replay
request `(start seq)` with every buffered `(seq, payload)` from there and `(-1, b"")`), the
same msgspec structs encoded by msgspec's msgpack encoder, and an engine-style block hash
that is *not* Fleet's (sha256 over a repr, the way vLLM hashes a pickle).

Like vLLM's, its PUB loses what it sends before the agent's subscription reached it; tests
warm up with empty batches until one arrives (`warm_up`)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections import deque
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from bench.engine_kv_layouts import MStored as BlockStored

ENCODER = msgspec.msgpack.Encoder()
END_SEQ = (-1).to_bytes(8, "big", signed=True)
REPLAY_BUFFER = 10_000  # batches an engine keeps for replay (vLLM's buffer_steps default)


def engine_hash(parent: bytes | None, tokens: list[int], extra: tuple[Any, ...] | None) -> bytes:
    """The stand-in engine's own block hash (never Fleet's)."""
    return hashlib.sha256(repr((parent, tuple(tokens), extra)).encode()).digest()


def stored_chain(
    tokens: list[int], block_size: int, salt: str | None, *, parent: bytes | None = None, medium: str = "GPU"
) -> tuple[BlockStored, list[bytes]]:
    """One BlockStored for the full blocks of `tokens` after `parent`, hashed the engine's way
    (the salt in the first block's extra keys, as vLLM does)."""
    hashes: list[bytes] = []
    extras: list[tuple[Any, ...] | None] = []
    prev = parent
    for i in range(0, len(tokens) - block_size + 1, block_size):
        extra = (salt,) if salt and prev is None else None
        prev = engine_hash(prev, tokens[i : i + block_size], extra)
        hashes.append(prev)
        extras.append(extra)
    n = len(hashes) * block_size
    return (
        BlockStored(hashes, parent, tokens[:n], block_size, None, medium, None, extras),
        hashes,
    )


class StandInPublisher:
    """The engine side of one replica's KV events (see the module docstring)."""

    def __init__(self, publish: str, replay: str | None, topic: bytes = b"kv-events") -> None:
        self.ctx = zmq.asyncio.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        if "*" in publish or "::" in publish or publish.startswith(("ipc://", "inproc://")):
            self.pub.bind(publish)  # vLLM's rule (ZmqEventPublisher._socket_setup)
        else:
            self.pub.connect(publish)
        self.router: zmq.asyncio.Socket | None = None
        if replay is not None:
            self.router = self.ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            # A ROUTER drops what passes its send high-water mark (1,000 by default) while
            # the I/O thread lags, as a busy CI box makes it do; the stand-in delivers its
            # whole buffer, so that a replay's count says what the follower did with it.
            self.router.setsockopt(zmq.SNDHWM, REPLAY_BUFFER + 1)
            self.router.bind(replay)
        self.topic = topic
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=REPLAY_BUFFER)
        self.replays: list[int] = []
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> StandInPublisher:
        if self.router is not None:
            self._task = asyncio.create_task(self._serve_replay())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.ctx.destroy(linger=0)

    async def send(self, batch: Any = None, *, payload: bytes | None = None, lose: bool = False) -> int:
        """Publish one batch (or raw payload bytes) under the next seq; `lose` keeps it in
        the replay buffer only, as if the PUB had dropped it."""
        data = payload if payload is not None else ENCODER.encode(batch)
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, data))
        if not lose:
            await self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), data])
        return seq

    def restart(self) -> None:
        """The engine restarted: its numbering and replay buffer start afresh."""
        self.seq = 0
        self.buffer.clear()

    async def _serve_replay(self) -> None:
        assert self.router is not None
        while True:
            frames = await self.router.recv_multipart()
            if len(frames) != 3:
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            self.replays.append(first)
            for seq, buf in list(self.buffer):
                if seq >= first:
                    await self.router.send_multipart([client, b"", seq.to_bytes(8, "big"), buf])
            await self.router.send_multipart([client, b"", END_SEQ, b""])
