"""The engine's outputs on the bus: each step's outputs become TokenEvents on JetStream, numbered
per reply from its stream (HeldReplies: contiguous sequence numbers, the assignment's owner epoch).
A step's events go out together in one TokenBatch (bus/token_batches.py), each reply's in order;
the steps that ran while a batch awaited its acknowledgement go out together in the next, so a
slow JetStream makes batches larger instead of a queue longer. A reply stops being held once its
final event (or its handoff's first token) is stored, and a prefill waiting for its handoff gets
the output that carries it then.

`run` ends only by raising (CannotPublish: the host fails) or by being cancelled."""

from __future__ import annotations

import asyncio

from nats.js import JetStreamContext

from tandem.bus import Bus
from tandem.bus.token_batches import BatchNumbers, batches
from tandem.engine.engine import RequestOutput
from tandem.v1.tokens_pb2 import TokenEvent
from tandem.worker.replies import HeldReplies, ReplyStream
from tandem.worker.token_publisher import open_token_stream, publish_event, publish_events, server_answers
from tandem.worker.wire import token_event


class OutputPublisher:
    def __init__(self, replies: HeldReplies, worker_id: str, model_name: str) -> None:
        self._replies = replies
        self._worker_id = worker_id
        self._model_name = model_name
        self._outbox: asyncio.Queue[list[RequestOutput]] = asyncio.Queue()
        self._handoffs: dict[str, asyncio.Future[RequestOutput]] = {}
        self._js: JetStreamContext | None = None  # once the token stream is there
        self._batch_ids = BatchNumbers(worker_id)

    @property
    def is_open(self) -> bool:
        """The token stream is there: events can be published."""
        return self._js is not None

    def put(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs, on the loop, to publish after those put before."""
        self._outbox.put_nowait(outputs)

    def expect_handoff(self, request_id: str) -> asyncio.Future[RequestOutput]:
        """Settled with the request's output that carries its handoff (or its last), once published."""
        prefilled = asyncio.get_running_loop().create_future()
        self._handoffs[request_id] = prefilled
        return prefilled

    def fail_handoffs(self, exc: BaseException) -> None:
        """Every handoff still expected raises `exc`: no output will come for them."""
        for prefilled in self._handoffs.values():
            if not prefilled.done():
                prefilled.set_exception(exc)
        self._handoffs.clear()

    async def publish(self, event: TokenEvent) -> None:
        """An event the worker makes itself; raises CannotPublish."""
        assert self._js is not None, "the token stream is not open yet"
        await publish_event(self._js, event)

    async def run(self, bus: Bus) -> None:
        client = await bus.wait_connected()
        js = self._js = await open_token_stream(client)
        while True:
            outputs = await self._outbox.get()
            while not self._outbox.empty():  # the steps that ran while the last batch was stored
                outputs = outputs + self._outbox.get_nowait()
            events: list[TokenEvent] = []
            ended: list[tuple[str, ReplyStream]] = []
            for output in outputs:
                stream = self._replies.stream_of(output.request_id)
                if stream is None:
                    continue
                events.append(token_event(output, stream.next_seq, self._worker_id, stream.epoch, self._model_name))
                stream.next_seq += 1
                if output.is_finished or output.handoff is not None:
                    ended.append((output.request_id, stream))
            bus_is_up = server_answers(client)
            for batch in batches(self._worker_id, events):
                await publish_events(js, batch, self._batch_ids.next_id(), bus_is_up=bus_is_up)
            for reply_id, stream in ended:
                self._replies.end_stream(reply_id, stream)
            for output in outputs:
                handoff = self._handoffs.pop(output.request_id, None) if output.is_finished or output.handoff is not None else None
                if handoff is not None and not handoff.done():
                    handoff.set_result(output)
