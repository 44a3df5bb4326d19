"""The KV handoff wire protocol: UCXX tag messages on one endpoint (connection) per sender and
receiver pair.

One transfer moves one reply's prompt KV, block by block, into blocks the decode worker reserved
for it (over gRPC, beforehand). On a connection, the sender numbers its transfers 1, 2, ... and
every message after the header carries that number in its tag, so transfers to one receiver may
run concurrently over one connection:

    sender                                              receiver
    HEADER   tag HEADER_TAG            ---------->      resolve(reply_id) -> the reservation;
             (magic, version, transfer id,              checks its token, then the count and
              reply id, num_blocks, bytes_per_block,    byte size of each destination block
              the reservation's token)
                                       <----------      VERDICT  tag (VERDICT, transfer id)
                                                        status OK, or a refusal with what the
                                                        receiver expected (num_blocks, bytes)
    BLOCK i  tag (BLOCK, transfer id, i), i = 0..n-1 ->  received straight into destination i
             (all n posted at once; UCX pipelines them)
                                       <----------      ACK      tag (ACK, transfer id)
                                                        status OK once every byte has landed

No payload byte is sent before the receiver said OK, so a refused transfer (unknown reply, a
token that is not the reservation's, count or size mismatch, the same reply already in flight, a bad header) writes nothing and
leaves the connection usable. Any other failure (timeout, peer gone, a failed send or receive)
aborts the connection on the side that saw it: UCX cancels the connection's outstanding
requests, so no late byte lands after the abort, and the other side's requests fail too.

Headers and statuses are little-endian fixed-size structs (one message each, so concurrent
transfers can never interleave their parts). Tags are Python ints, which ucxx hashes together
with the connection's own tag; an int's hash is the same in every process (a str's is not).
Block payloads are the blocks' raw bytes: both sides agreed on dtype and layout at Reserve.

The token is the reservation's own random secret (Reservation.transfer_token, handed over the
authenticated gRPC Reserve): a peer that merely knows a reply id cannot write into its blocks.
"""

from __future__ import annotations

import enum
import secrets
import struct
from dataclasses import dataclass

import numpy as np
import torch

MAGIC = b"TKV1"
VERSION = 2  # 2: the header carries the reservation's token
MAX_REPLY_ID_BYTES = 226
TOKEN_BYTES = 32
MAX_BLOCKS = 1 << 28  # the block index has 28 bits of the tag

# magic, version, reserved, transfer id, num_blocks, bytes_per_block, token, reply id length
_HEADER = struct.Struct(f"<4sHHQIQ{TOKEN_BYTES}sH")
HEADER_BYTES = _HEADER.size + MAX_REPLY_ID_BYTES
_STATUS = struct.Struct("<IIQ")  # status, num_blocks, bytes_per_block
STATUS_BYTES = _STATUS.size


def new_token() -> bytes:
    """A reservation's transfer token: random, TOKEN_BYTES long."""
    return secrets.token_bytes(TOKEN_BYTES)


class Kind(enum.IntEnum):
    HEADER = 1
    VERDICT = 2
    BLOCK = 3
    ACK = 4


def tag(kind: Kind, transfer_id: int = 0, index: int = 0) -> int:
    return (transfer_id << 32) | (kind << 28) | index


HEADER_TAG = tag(Kind.HEADER)


class Status(enum.IntEnum):
    OK = 0
    UNKNOWN_REPLY = 1  # resolve() returned None: no reservation for this reply id
    COUNT_MISMATCH = 2
    SIZE_MISMATCH = 3
    IN_FLIGHT = 4  # a transfer of the same reply is still being received
    BAD_HEADER = 5  # wrong magic or version, or a reply id that is not UTF-8
    NO_DESTINATION = 6  # the receiver's resolve() failed or gave memory it cannot receive into
    BAD_TOKEN = 7  # the token is not the one the reservation was made with


class BadHeader(ValueError):
    def __init__(self, message: str, transfer_id: int = 0) -> None:
        super().__init__(message)
        self.transfer_id = transfer_id  # 0 when it could not be read


@dataclass(frozen=True)
class Header:
    transfer_id: int
    reply_id: str
    num_blocks: int
    bytes_per_block: int
    token: bytes = b""  # the reservation's; at most TOKEN_BYTES (zero-padded on the wire)

    def pack(self) -> np.ndarray:
        reply_id = self.reply_id.encode()
        out = np.zeros(HEADER_BYTES, np.uint8)
        fields = (self.transfer_id, self.num_blocks, self.bytes_per_block, self.token, len(reply_id))
        _HEADER.pack_into(out.data, 0, MAGIC, VERSION, 0, *fields)
        out[_HEADER.size : _HEADER.size + len(reply_id)] = np.frombuffer(reply_id, np.uint8)
        return out

    @classmethod
    def unpack(cls, data: np.ndarray) -> Header:
        """Raises BadHeader, with the transfer id when it could be read (0 otherwise)."""
        magic, version, _, transfer_id, num_blocks, bytes_per_block, token, id_len = _HEADER.unpack_from(data.data, 0)
        if magic != MAGIC or version != VERSION:
            raise BadHeader(f"magic {magic!r} version {version}, expected {MAGIC!r} version {VERSION}", transfer_id)
        if id_len > MAX_REPLY_ID_BYTES:
            raise BadHeader(f"reply id of {id_len} bytes, at most {MAX_REPLY_ID_BYTES} fit", transfer_id)
        try:
            reply_id = bytes(data[_HEADER.size : _HEADER.size + id_len]).decode()
        except UnicodeDecodeError as exc:
            raise BadHeader(f"reply id is not UTF-8: {exc}", transfer_id) from None
        return cls(transfer_id, reply_id, num_blocks, bytes_per_block, token)


@dataclass(frozen=True)
class Reply:
    """A verdict or an acknowledgement; on a refusal, what the receiver holds for the reply."""

    status: Status
    num_blocks: int = 0
    bytes_per_block: int = 0

    def pack(self) -> np.ndarray:
        out = np.zeros(STATUS_BYTES, np.uint8)
        _STATUS.pack_into(out.data, 0, self.status, self.num_blocks, self.bytes_per_block)
        return out

    @classmethod
    def unpack(cls, data: np.ndarray) -> Reply:
        status, num_blocks, bytes_per_block = _STATUS.unpack_from(data.data, 0)
        try:
            return cls(Status(status), num_blocks, bytes_per_block)
        except ValueError:
            raise BadHeader(f"unknown status {status}") from None


def as_buffer(block: torch.Tensor) -> np.ndarray | torch.Tensor:
    """A block's bytes, zero-copy, as ucxx takes them: a uint8 numpy view of a CPU tensor (numpy has
    no bf16), or a uint8 CUDA tensor (ucxx reads its __cuda_array_interface__)."""
    if not block.is_contiguous():
        raise ValueError(f"a block must be contiguous, got shape {tuple(block.shape)} strides {block.stride()}")
    flat = block.detach().reshape(-1).view(torch.uint8)
    if flat.is_cuda:
        return flat
    if flat.device.type != "cpu":
        raise ValueError(f"blocks on {flat.device} cannot be transferred (CPU or CUDA only)")
    return flat.numpy()


def nbytes(block: torch.Tensor) -> int:
    return block.numel() * block.element_size()


def describe_error(exc: BaseException) -> str:
    """The first real error inside a TaskGroup's exception groups, for a log line or a message."""
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"
