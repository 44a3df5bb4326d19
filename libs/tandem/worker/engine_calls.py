"""What a worker asks of its engine, as module-level functions that take the engine last: the host
sends functools.partial of them, which run on the engine thread or travel pickled to the engine
process (a closure would not pickle). The engine process imports this module to unpickle them, so
it imports nothing NATS-facing."""

from __future__ import annotations

from tandem.engine.block_pool import CachedBlock
from tandem.engine.engine import Engine, ImportReservation, Request


def add(request: Request, engine: Engine, prefill_only: bool = False) -> None:
    engine.add(request, prefill_only=prefill_only)


def abort(reply_id: str, engine: Engine) -> None:
    engine.abort(reply_id)


def discard(reply_id: str, engine: Engine) -> None:
    engine.discard(reply_id)


def release(reply_id: str, engine: Engine) -> None:
    engine.release(reply_id)


def reserve_import(request: Request, num_blocks: int, engine: Engine) -> ImportReservation:
    return engine.reserve_import(request, num_blocks)


def cancel_import(reservation: ImportReservation, engine: Engine) -> None:
    engine.cancel_import(reservation)


def import_sequence(request: Request, reservation: ImportReservation, first_token_id: int, num_cached_tokens: int, engine: Engine) -> None:
    engine.import_sequence(request, reservation, first_token_id, num_cached_tokens)


def cached_blocks(engine: Engine) -> list[CachedBlock]:
    return engine.cached_blocks()
