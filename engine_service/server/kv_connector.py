"""KV transfer connectors: how a prefill replica's blocks reach a decode replica (prefill/decode disaggregation).

One small interface: `send` the blocks of a request (engine/kv_transfer.py KVBlocks) and get a handle, `receive` a
handle's blocks on the other side (taking them: a handle is read once), `release` a handle nobody will read. The
prefill side pushes; the decode side pulls when it takes the request, off its engine thread, and then writes the
blocks into free blocks of its own pool (they become cached prefix blocks there).

Redis is the first transport: one string per transfer under `<p>:kvx:<request id>`, with a time-to-live, so a
transfer whose request moved elsewhere, or whose decode replica died before reading it, leaves nothing behind.
`receive` is GETDEL: a replica that takes a request over after the first decode replica died finds the key gone and
computes the prompt again, which is always correct. Between GPUs, NIXL or LMCache would replace this class: the
decode side reserves blocks and the prefill side writes them by RDMA, with the same send / receive / release.
"""
from __future__ import annotations

import json
import struct
import time
from typing import Protocol

import redis

from engine_service.engine.kv_transfer import KVBlocks
from shared.keys import Keys

HEADER = struct.Struct("<I")  # the JSON header's length, then the header, then every block's bytes in order


class KVConnector(Protocol):
    def send(self, request_id: str, blocks: KVBlocks) -> str: ...

    def receive(self, handle: str) -> tuple[KVBlocks, float] | None: ...  # the blocks, the time they were sent

    def release(self, handle: str) -> None: ...


def encode_blocks(blocks: KVBlocks) -> bytes:
    header = json.dumps({"block_size": blocks.block_size, "kv_dtype": blocks.kv_dtype,
                         "block_shape": blocks.block_shape, "hashes": [h.hex() for h in blocks.hashes],
                         "sizes": [len(d) for d in blocks.data], "sent_at": time.time()}).encode()
    return HEADER.pack(len(header)) + header + b"".join(blocks.data)


def decode_blocks(raw: bytes) -> tuple[KVBlocks, float]:
    """The blocks and the time they were sent (ValueError for anything malformed)."""
    try:
        (n,) = HEADER.unpack_from(raw)
        header = json.loads(raw[HEADER.size:HEADER.size + n])
        data, at = [], HEADER.size + n
        for size in header["sizes"]:
            data.append(raw[at:at + size])
            at += size
        if at != len(raw) or len(data) != len(header["hashes"]):
            raise ValueError("kv transfer: truncated")
        return KVBlocks(header["block_size"], header["kv_dtype"], header["block_shape"],
                        [bytes.fromhex(h) for h in header["hashes"]], data), float(header["sent_at"])
    except (struct.error, KeyError, TypeError) as e:
        raise ValueError(f"kv transfer: malformed ({e})") from None


class RedisKVConnector:
    def __init__(self, url: str, keys: Keys, ttl_s: float = 30.0):
        # bytes in and out (the replica's own client decodes replies as text)
        self.redis = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=10)
        self.keys, self.ttl_ms = keys, int(ttl_s * 1000)

    def send(self, request_id: str, blocks: KVBlocks) -> str:
        handle = self.keys.kv_transfer(request_id)
        self.redis.set(handle, encode_blocks(blocks), px=self.ttl_ms)
        return handle

    def receive(self, handle: str) -> tuple[KVBlocks, float] | None:
        """The blocks and when they were sent, taken from Redis; None if expired, gone or malformed."""
        raw = self.redis.getdel(handle)
        if raw is None:
            return None
        try:
            return decode_blocks(raw)
        except ValueError:
            return None

    def release(self, handle: str) -> None:
        self.redis.delete(handle)

    def close(self) -> None:
        self.redis.close()
