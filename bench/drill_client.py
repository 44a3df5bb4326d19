"""One drill client: a streamed reply through the chat API, read to its end, with disconnects
and resumes (Last-Event-ID) across chat instances, and what it saw: outcome, text, TTFT, the
longest pause between events, whether the event ids were contiguous. Also the drills' prompts."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

HANG_S = 60.0
TOPICS = (
    "how a bicycle stays upright",
    "why the sky is blue",
    "how vaccines train the immune system",
    "the water cycle",
    "how jet engines work",
    "photosynthesis in desert plants",
    "how GPS satellites keep time",
    "the rules of cricket",
    "composting in a small apartment",
    "learning a second language as an adult",
    "the history of the printing press",
    "sourdough baking at high altitude",
    "caring for a young cat",
    "writing a good cover letter",
    "the causes of the 2008 financial crisis",
    "how tides work",
)


def prompt_of(index: int, long: bool = False) -> str:
    topic = TOPICS[index % len(TOPICS)]
    text = f"Explain {topic} in a few short paragraphs. (request {index})"
    if long:  # long enough to be prefilled remotely (> TANDEM_REMOTE_PREFILL_MIN_TOKENS)
        background = " ".join(f"Note {k}: {TOPICS[(index + k) % len(TOPICS)]} is a topic people ask about." for k in range(18))
        text = f"{background}\n\n{text}"
    return text


@dataclass
class StreamResult:
    index: int
    outcome: str = "hung"  # complete | error | hung | refused
    text: str = ""
    error: str = ""
    num_events: int = 0
    longest_pause_s: float = 0.0
    longest_pause_ended_unix_s: float = 0.0  # when the longest pause ended (wall clock), to find it in the logs
    ttft_s: float = 0.0  # from sending the message to its first token
    ids_contiguous: bool = True
    num_resumes: int = 0
    message_id: str = ""
    conversation_id: str = ""
    event_unix_s: list[float] = field(default_factory=list)  # when each event came (wall clock)

    def wait_after(self, unix_s: float) -> float | None:
        """How long after `unix_s` its next event came; None when it had ended by then (or never
        got an event after it)."""
        later = [t for t in self.event_unix_s if t >= unix_s]
        return round(later[0] - unix_s, 2) if later else None


@dataclass
class Client:
    urls: list[str]  # chat instances; resumes alternate between them
    key: str
    max_tokens: int
    hang_s: float = HANG_S

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    async def run(
        self,
        http: httpx.AsyncClient,
        index: int,
        prompt: str,
        started: asyncio.Event | None = None,
        disconnects: int = 0,
        rng: random.Random | None = None,
    ) -> StreamResult:
        """Sends `prompt` in a new conversation (greedy) and reads the reply to its end; with
        `disconnects`, drops the connection that many times at random points and resumes with
        Last-Event-ID on the next chat instance. As a browser behind a load balancer would, it
        sends a request that could not connect to the next chat instance, and resumes a stream
        that broke on the next one too."""
        result = StreamResult(index)
        deadline = time.monotonic() + self.hang_s
        try:
            created, instance = await self._send(http, deadline, 0, lambda url: http.build_request(
                "POST", f"{url}/v1/conversations", json={}, headers=self.headers))  # fmt: skip
            try:
                await created.aread()
                created.raise_for_status()
                result.conversation_id = created.json()["id"]
            finally:
                await created.aclose()
            body = {"content": prompt, "temperature": 0, "max_tokens": self.max_tokens}

            def post_message(url: str) -> httpx.Request:
                return http.build_request(
                    "POST", f"{url}/v1/conversations/{result.conversation_id}/messages", json=body, headers=self.headers
                )

            def resume(url: str) -> httpx.Request:
                headers = {**self.headers, "Last-Event-ID": str(last_id)}
                return http.build_request("GET", f"{url}/v1/messages/{result.message_id}/stream", headers=headers)

            build = post_message
            sent_s = time.monotonic()
            last_id = 0
            last_event_s = time.monotonic()
            drops_left = disconnects
            while True:
                response, instance = await self._send(http, deadline, instance, build)
                try:
                    if response.status_code != 200:
                        result.outcome = "refused"
                        result.error = f"{response.status_code}: {(await response.aread())[:200]!r}"
                        return result
                    drop_after = rng.randint(1, 6) if drops_left > 0 and rng is not None else None
                    seen_here = 0
                    async for sse in sse_events(response, deadline):
                        now_s = time.monotonic()
                        # A pause is a gap after the answer began (the wait for the first token is TTFT, not a pause).
                        if result.text and now_s - last_event_s > result.longest_pause_s:
                            result.longest_pause_s = now_s - last_event_s
                            result.longest_pause_ended_unix_s = round(time.time(), 3)
                        last_event_s = now_s
                        result.event_unix_s.append(time.time())
                        result.num_events += 1
                        if sse.id:
                            if last_id and sse.id != last_id + 1:
                                result.ids_contiguous = False
                            last_id = sse.id
                        if sse.event == "meta":
                            result.message_id = sse.data.get("message_id", result.message_id)
                        elif sse.event == "delta":
                            if not result.text:
                                result.ttft_s = round(now_s - sent_s, 3)
                            result.text += sse.data.get("text", "")
                        elif sse.event == "done":
                            result.outcome = "complete"
                            return result
                        elif sse.event == "error":
                            result.outcome = "error"
                            result.error = str(sse.data.get("message", sse.data))[:300]
                            return result
                        if started is not None and sse.event == "delta":
                            started.set()
                        seen_here += 1
                        if drop_after is not None and seen_here >= drop_after:
                            drops_left -= 1
                            break
                except httpx.TransportError:  # the instance went away mid-stream: resumed below
                    if not result.message_id:
                        raise
                finally:
                    await response.aclose()
                if time.monotonic() >= deadline:
                    return result  # hung
                # The connection ended before the final event (dropped here, or broken): resume.
                if not result.message_id:
                    result.error = "the stream ended before its meta event"
                    return result
                result.num_resumes += 1
                instance = (instance + 1) % len(self.urls)
                build = resume
        except (httpx.HTTPError, OSError) as exc:
            result.outcome = "hung" if time.monotonic() >= deadline else "error"
            result.error = f"{type(exc).__name__}: {exc}"[:300]
            return result

    async def _send(
        self, http: httpx.AsyncClient, deadline: float, instance: int, build: Callable[[str], httpx.Request]
    ) -> tuple[httpx.Response, int]:
        """`build(url)` sent to chat instance `instance`, streamed; a refused connection (the
        request never arrived) goes to the next instance, and after a round of refusals waits a
        moment (a backoff, up to 1 s) before the next round, until `deadline`."""
        delay_s = 0.1
        for tried in itertools.count(1):
            try:
                return await http.send(build(self.urls[instance]), stream=True), instance
            except httpx.ConnectError:
                if time.monotonic() + delay_s >= deadline:
                    raise
                instance = (instance + 1) % len(self.urls)
                if tried % len(self.urls) == 0:
                    await asyncio.sleep(delay_s)
                    delay_s = min(1.0, delay_s * 2)
        raise AssertionError("unreachable")


@dataclass
class _Sse:
    id: int
    event: str
    data: dict[str, Any]


async def sse_events(response: httpx.Response, deadline: float):  # type: ignore[no-untyped-def]
    fields: dict[str, str] = {}
    lines = response.aiter_lines()
    while True:
        left_s = deadline - time.monotonic()
        if left_s <= 0:
            return
        try:
            line = await asyncio.wait_for(anext(lines), timeout=left_s)
        except (StopAsyncIteration, TimeoutError):
            return
        if line == "":
            if "data" in fields:
                try:
                    data = json.loads(fields["data"])
                except json.JSONDecodeError:
                    data = {"raw": fields["data"]}
                yield _Sse(int(fields.get("id", "0") or 0), fields.get("event", "message"), data)
            fields = {}
        elif not line.startswith(":"):
            name, _, value = line.partition(":")
            fields[name] = fields.get(name, "") + value.removeprefix(" ")
