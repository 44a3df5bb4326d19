"""Every message read from the bus is checked here before a service uses it: decoded as its one
type, every id a subject token that matches the subject it came on, every size bounded, every
number finite and in range, every address a sane host:port, every enum known. A message that
fails is dropped by its subscriber with `drop`: counted by kind and reason, logged once per
sender subject, never raised out of a NATS callback.

The bounds are the protocol's, not a deployment's: each is well above what the product sends (the
chat's own request limits are lower) and far below what would hurt a reader."""

from __future__ import annotations

import ipaddress
import logging
import math
import re
from collections.abc import Iterable

from prometheus_client import Counter

from tandem import model_ids
from tandem.bus import subjects
from tandem.bus.codec import BadMessage, M, decode
from tandem.bus.events import is_final
from tandem.engine.sequence import MAX_TOP_LOGPROBS  # alternatives per token, as the engine's SamplingOptions checks them
from tandem.v1 import common_pb2
from tandem.v1.dispatch_pb2 import Assignment, AssignmentReply, HandoffOutcome
from tandem.v1.generate_pb2 import GenerateReply, GenerateRequest, Refusal
from tandem.v1.kv_pb2 import KvEvent, KvState, StoredBlock
from tandem.v1.tokens_pb2 import Cancel, TokenBatch, TokenEvent
from tandem.v1.worker_pb2 import LadderStatus, ReplyOutcome, RolloutStatus, VersionWindow, WorkerHeartbeat

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 8 << 20
MAX_ID_CHARS = 128  # reply, request, instance, worker, user and conversation ids
MAX_NAME_CHARS = 256  # model names, reasons, versions
MAX_CODE_CHARS = 64  # an error code or refusal reason: a subject token
MAX_MESSAGE_CHARS = 1024  # a refusal's or an error's words
MAX_TEXT_CHARS = 64 << 10  # one token event's text
MAX_URL_CHARS = 2048
MAX_PROMPT_TOKENS = 1 << 20
MAX_OUTPUT_TOKENS = 1 << 20
MAX_VOCAB_SIZE = 1 << 22  # the bound on a token id where the vocabulary is not known
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_BATCH_EVENTS = 1 << 14  # token events in one TokenBatch
MAX_REPLY_IDS = 1 << 16  # replies one worker claims in a heartbeat
MAX_BLOCKS = 1 << 20  # KV blocks in one event or state
MAX_BLOCK_TOKENS = 1 << 16
MAX_SEQ = 1 << 48
MAX_RUNG = 16
MAX_INTERVAL_S = 3600.0
MAX_ROLLOUT_MODELS = 256  # models in one RolloutStatus
MAX_TTFT_S = 86400.0
WORKER_ROLES = frozenset({"prefill", "decode"})
LANES = frozenset(common_pb2.Lane.values())
FINISHES = frozenset(common_pb2.FinishReason.values())
_HOST_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")

DROPPED = Counter("tandem_bus_messages_dropped", "Bus messages dropped by validation", ["kind", "reason"])
_MAX_LOGGED = 4096
_logged: set[tuple[str, str, str]] = set()


class Invalid(ValueError):
    """A bus message that fails a check. `reason` is a stable label (the drop counter's), the
    message says which field and why, for the log; neither is ever shown to a client."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def drop(kind: str, subject: str, error: Invalid) -> None:
    """Counts a dropped message and logs it, once per kind, reason and sender subject (a flood
    from one sender costs one line)."""
    DROPPED.labels(kind=kind, reason=error.reason).inc()
    key = (kind, error.reason, subject)
    if key in _logged:
        log.debug("dropped a %s on %s: %s", kind, subject, error)
        return
    if len(_logged) < _MAX_LOGGED:
        _logged.add(key)
    log.warning("dropped a %s on %s (%s): %s; more like it are counted, not logged", kind, subject, error.reason, error)


# The checks every message is made of.


def check_bytes(data: bytes) -> None:
    if len(data) > MAX_MESSAGE_BYTES:
        raise Invalid("too_large", f"{len(data)} bytes; at most {MAX_MESSAGE_BYTES}")


def decoded(data: bytes, message_type: type[M]) -> M:
    check_bytes(data)
    try:
        return decode(data, message_type)
    except BadMessage as exc:
        raise Invalid("undecodable", str(exc)) from None


def check_id(value: str, what: str, *, is_required: bool = True) -> None:
    """An id that names a subject: letters, digits, '-' and '_', at most MAX_ID_CHARS."""
    if not value:
        if is_required:
            raise Invalid("bad_id", f"{what} is empty")
        return
    if len(value) > MAX_ID_CHARS or not subjects.is_token(value):
        raise Invalid("bad_id", f"{what} {value[:MAX_ID_CHARS]!r} is not an id (letters, digits, '-', '_'; at most {MAX_ID_CHARS})")


def check_id_of_subject(value: str, subject: str, what: str) -> None:
    """`value` is the id at the end of the subject the message came on."""
    check_id(value, what)
    if value != subjects.reply_id_of(subject):
        raise Invalid("id_mismatch", f"{what} {value!r} is not the one its subject names")


def check_chars(value: str, what: str, limit: int) -> None:
    if len(value) > limit:
        raise Invalid("too_large", f"{what} has {len(value)} characters; at most {limit}")


def check_count(num: int, what: str, limit: int) -> None:
    if num > limit:
        raise Invalid("too_large", f"{num} {what}; at most {limit}")


def check_code(value: str, what: str) -> None:
    """A stable machine name (refusal reason, error code): a subject token, or empty."""
    if value and (len(value) > MAX_CODE_CHARS or not subjects.is_token(value)):
        raise Invalid("bad_code", f"{what} {value[:MAX_CODE_CHARS]!r} is not a code")


def check_number(value: float, what: str, *, low: float = 0.0, high: float = math.inf) -> None:
    if not math.isfinite(value):
        raise Invalid("out_of_range", f"{what} is {value}")
    if not low <= value <= high:
        raise Invalid("out_of_range", f"{what} is {value:g}; it must be in [{low:g}, {high:g}]")


def check_token_ids(token_ids: Iterable[int], what: str, vocab_size: int | None) -> None:
    bound = vocab_size or MAX_VOCAB_SIZE
    largest = max(token_ids, default=0)
    if largest >= bound:
        raise Invalid("out_of_range", f"{what} holds token id {largest}; the vocabulary has {bound}")


def check_enum(value: int, known: frozenset[int], what: str) -> None:
    if value not in known:
        raise Invalid("unknown_enum", f"{what} {value} is not one this version knows")


def check_address(address: str, what: str, *, is_required: bool = True) -> None:
    """host:port with a host name or an IP address ([...] for IPv6) and a port in 1..65535."""
    if not address:
        if is_required:
            raise Invalid("bad_address", f"{what} is empty")
        return
    check_chars(address, what, 300)
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise Invalid("bad_address", f"{what} {address!r} has no port in 1..65535")
    if not is_sane_host(host):
        raise Invalid("bad_address", f"{what} {address!r} names no host")


def is_sane_host(host: str) -> bool:
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            return ipaddress.ip_address(host).version == 6
        except ValueError:
            return False
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    labels = host.rstrip(".").split(".")
    return 0 < len(host) <= 253 and all(_HOST_LABEL.match(label) for label in labels)


def check_refusal(refusal: Refusal) -> None:
    check_code(refusal.reason, "refusal reason")
    check_chars(refusal.message, "refusal message", MAX_MESSAGE_CHARS)
    check_number(refusal.retry_after_s, "retry_after_s", high=MAX_INTERVAL_S)


def check_request(request: GenerateRequest, vocab_size: int | None = None) -> None:
    """The bounds of a generate request; what admission decides (an empty prompt, max_tokens of 0,
    a prompt too long for the model) is left to it, so its refusals keep their reasons."""
    for field in ("request_id", "user_id", "tenant", "conversation_id"):
        check_chars(getattr(request, field), field, MAX_ID_CHARS)
    check_id(request.reply_id, "reply_id", is_required=False)
    check_id(request.resume_reply_id, "resume_reply_id", is_required=False)
    check_chars(request.model, "model", MAX_NAME_CHARS)
    check_id(request.shadow_of, "shadow_of", is_required=False)
    check_enum(request.lane, LANES, "lane")
    check_count(len(request.prompt_token_ids), "prompt tokens", MAX_PROMPT_TOKENS)
    check_count(len(request.generated_token_ids), "generated tokens", MAX_OUTPUT_TOKENS)
    check_token_ids(request.prompt_token_ids, "the prompt", vocab_size)
    check_token_ids(request.generated_token_ids, "the generated tokens", vocab_size)
    sampling = request.sampling
    check_count(sampling.max_tokens, "max_tokens", MAX_OUTPUT_TOKENS)
    check_count(len(sampling.stop), "stop strings", MAX_STOP_STRINGS)
    for stop in sampling.stop:
        check_chars(stop, "a stop string", MAX_STOP_CHARS)
    check_count(len(sampling.stop_token_ids), "stop token ids", MAX_STOP_TOKEN_IDS)
    check_token_ids(sampling.stop_token_ids, "stop_token_ids", vocab_size)
    for field in ("temperature", "top_p", "min_p"):
        value = getattr(sampling, field)
        if not math.isfinite(value):
            raise Invalid("out_of_range", f"sampling.{field} is {value}")
    check_count(sampling.top_logprobs, "top_logprobs", MAX_TOP_LOGPROBS)


def check_blocks(blocks: Iterable[StoredBlock], num_blocks: int) -> None:
    check_count(num_blocks, "KV blocks", MAX_BLOCKS)
    for block in blocks:
        check_count(block.num_tokens, "tokens in a KV block", MAX_BLOCK_TOKENS)


# One parser per kind of message: the message, checked, or Invalid.


def worker_heartbeat(data: bytes, subject: str) -> WorkerHeartbeat:
    """A worker's heartbeat, from `tandem.v1.heartbeat.<role>.<instance_id>`: the only source of
    the addresses a router hands out."""
    heartbeat = decoded(data, WorkerHeartbeat)
    service = heartbeat.service
    check_id_of_subject(service.instance_id, subject, "instance_id")
    if not service.role:  # unsaid: the subject's
        service.role = subject.rsplit(".", 2)[-2]
    if service.role not in WORKER_ROLES or subject != subjects.heartbeat(service.role, service.instance_id):
        raise Invalid("id_mismatch", f"role {service.role[:MAX_NAME_CHARS]!r} is not the worker role its subject names")
    check_chars(service.version, "version", MAX_NAME_CHARS)
    check_chars(service.http_url, "http_url", MAX_URL_CHARS)
    check_number(service.interval_s, "interval_s", high=MAX_INTERVAL_S)
    check_chars(heartbeat.model, "model", MAX_NAME_CHARS)
    check_address(heartbeat.grpc_address, "grpc_address", is_required=False)
    check_address(heartbeat.ucx_address, "ucx_address", is_required=False)
    if heartbeat.kv_blocks_free > heartbeat.kv_blocks_total:
        raise Invalid("out_of_range", f"{heartbeat.kv_blocks_free} free KV blocks of {heartbeat.kv_blocks_total}")
    check_count(heartbeat.kv_block_size, "tokens per KV block", MAX_BLOCK_TOKENS)
    check_count(heartbeat.max_model_len, "tokens of context", MAX_PROMPT_TOKENS + MAX_OUTPUT_TOKENS)
    check_count(len(heartbeat.reply_ids), "claimed replies", MAX_REPLY_IDS)
    for reply_id in heartbeat.reply_ids:
        check_id(reply_id, "a claimed reply id")
    for field in ("step_time_ms", "prefill_tokens_per_s", "estimated_wait_s", "free_ttft_target_s"):
        check_number(getattr(heartbeat, field), field)
    return heartbeat


def kv_event(data: bytes, subject: str) -> KvEvent:
    """A worker's KV event, from `tandem.v1.kv.events.<worker_id>`; its worker id is the subject's."""
    event = decoded(data, KvEvent)
    if not event.worker_id:
        event.worker_id = subjects.reply_id_of(subject)
    check_id_of_subject(event.worker_id, subject, "worker_id")
    change = event.WhichOneof("change")
    if change == "stored":
        check_blocks(event.stored.blocks, len(event.stored.blocks))
    elif change == "removed":
        check_count(len(event.removed.block_hashes), "removed KV blocks", MAX_BLOCKS)
    elif change is None:
        raise Invalid("unknown_enum", "the event changes nothing")
    return event


def kv_state(data: bytes, worker_id: str) -> KvState:
    state = decoded(data, KvState)
    if state.worker_id and state.worker_id != worker_id:
        raise Invalid("id_mismatch", f"the state of {state.worker_id!r} answers a request to {worker_id!r}")
    check_blocks(state.blocks, len(state.blocks))
    return state


def generate_request(data: bytes, vocab_size: int | None = None) -> GenerateRequest:
    request = decoded(data, GenerateRequest)
    check_request(request, vocab_size)
    return request


def generate_reply(data: bytes) -> GenerateReply:
    reply = decoded(data, GenerateReply)
    outcome = reply.WhichOneof("outcome")
    if outcome == "reply_id":
        check_id(reply.reply_id, "reply_id")
    elif outcome == "refused":
        check_refusal(reply.refused)
    else:
        raise Invalid("unknown_enum", "the reply neither accepts nor refuses")
    check_chars(reply.model, "model", MAX_NAME_CHARS)
    check_chars(reply.shadow_model, "shadow_model", MAX_NAME_CHARS)
    return reply


def assignment(data: bytes, vocab_size: int | None = None) -> Assignment:
    """A reply handed to a worker: a decode worker's address, if any, as sane as a heartbeat's."""
    handed = decoded(data, Assignment)
    check_id(handed.reply_id, "reply_id")
    check_request(handed.request, vocab_size)
    check_id(handed.decode_worker_id, "decode_worker_id", is_required=False)
    check_address(handed.decode_grpc_address, "decode_grpc_address", is_required=False)
    check_count(handed.first_seq, "first_seq", MAX_SEQ)
    return handed


def assignment_reply(data: bytes) -> AssignmentReply:
    reply = decoded(data, AssignmentReply)
    if reply.WhichOneof("outcome") == "refused":
        check_refusal(reply.refused)
    check_id(reply.failed_decode_worker_id, "failed_decode_worker_id", is_required=False)
    return reply


def handoff_outcome(data: bytes, subject: str) -> HandoffOutcome:
    outcome = decoded(data, HandoffOutcome)
    check_id_of_subject(outcome.reply_id, subject, "reply_id")
    check_enum(outcome.result, frozenset(HandoffOutcome.Result.values()), "result")
    check_id(outcome.prefill_worker_id, "prefill_worker_id", is_required=False)
    check_id(outcome.decode_worker_id, "decode_worker_id", is_required=False)
    check_code(outcome.reason, "reason")
    check_chars(outcome.message, "message", MAX_MESSAGE_CHARS)
    check_count(len(outcome.published_token_ids), "published tokens", MAX_OUTPUT_TOKENS)
    check_token_ids(outcome.published_token_ids, "published_token_ids", None)
    return outcome


def token_event(data: bytes, subject: str, vocab_size: int | None = None) -> TokenEvent:
    """A reply's event, from `tandem.v1.tokens.<reply_id>` (workers), or a final one from
    `tandem.v1.finals.<reply_id>` (the router or a relay). An error in it reaches clients as is,
    so its code must be a code and its message short."""
    event = decoded(data, TokenEvent)
    check_id_of_subject(event.reply_id, subject, "reply_id")
    if subject.startswith(subjects.FINALS_ALL.removesuffix(">")) and not is_final(event):
        raise Invalid("not_final", f"event {event.seq} on a finals subject is not final: only workers send tokens")
    check_token_event(event, vocab_size)
    return event


def token_batch(data: bytes, subject: str, vocab_size: int | None = None) -> tuple[list[TokenEvent], list[Invalid]]:
    """A worker's step from `tandem.v1.tokens.batch.<worker_id>`: its events that pass `token_event`'s checks (each
    the subject's worker's), and why each other fails; Invalid when the batch is bad (undecodable, too large)."""
    batch = decoded(data, TokenBatch)
    check_id_of_subject(batch.worker_id, subject, "worker_id")
    check_count(len(batch.events), "events", MAX_BATCH_EVENTS)
    events, invalid = [], []
    for event in batch.events:
        try:
            check_id_of_subject(event.worker_id, subject, "worker_id")
            check_token_event(event, vocab_size)
            events.append(event)
        except Invalid as exc:
            invalid.append(exc)
    return events, invalid


def check_token_event(event: TokenEvent, vocab_size: int | None = None) -> None:  # all but its subject's
    check_id(event.reply_id, "reply_id")
    check_count(event.seq, "seq", MAX_SEQ)
    if event.seq < 1:
        raise Invalid("out_of_range", "seq is 0; a reply's events count from 1")
    check_token_ids([event.token_id], "token_id", vocab_size)
    check_chars(event.text, "text", MAX_TEXT_CHARS)
    check_enum(event.finish, FINISHES, "finish")
    check_code(event.error.code, "error code")
    check_chars(event.error.message, "error message", MAX_MESSAGE_CHARS)
    if event.error.HasField("retry_after_s"):
        check_number(event.error.retry_after_s, "error retry_after_s", high=MAX_INTERVAL_S)
    check_code(event.stop_reason, "stop_reason")  # reaches clients as is
    check_id(event.worker_id, "worker_id", is_required=False)
    check_count(len(event.top_logprobs), "top logprobs", MAX_TOP_LOGPROBS)
    check_token_ids([t.token_id for t in event.top_logprobs], "top_logprobs", vocab_size)
    for logprob in [event.logprob, *(t.logprob for t in event.top_logprobs)]:
        if not logprob <= 0.0:  # NaN too; -inf is a probability of 0
            raise Invalid("out_of_range", f"a logprob is {logprob}")


def cancel(data: bytes, subject: str) -> Cancel:
    """A cancel from `tandem.v1.cancel.<reply_id>` (an empty reply_id is the subject's)."""
    cancelled = decoded(data, Cancel)
    if not cancelled.reply_id:
        cancelled.reply_id = subjects.reply_id_of(subject)
    check_id_of_subject(cancelled.reply_id, subject, "reply_id")
    check_chars(cancelled.reason, "reason", MAX_NAME_CHARS)
    return cancelled


def ladder_status(data: bytes) -> LadderStatus:
    status = decoded(data, LadderStatus)
    check_id(status.router_id, "router_id")
    check_count(status.rung, "rung", MAX_RUNG)
    for field in ("busyness", "kv_occupancy", "queue_pressure"):
        check_number(getattr(status, field), field, high=1.0)
    check_number(status.interval_s, "interval_s", high=MAX_INTERVAL_S)
    return status


def rollout_status(data: bytes) -> RolloutStatus:
    status = decoded(data, RolloutStatus)
    check_id(status.router_id, "router_id")
    check_number(status.interval_s, "interval_s", high=MAX_INTERVAL_S)
    check_count(len(status.models), "models", MAX_ROLLOUT_MODELS)
    for model in status.models:
        check_served_id(model.model, "model")
        if model_ids.is_versioned(model.model):
            raise Invalid("bad_id", f"model {model.model!r} has a version: a rollout is per name")
        for field in ("stable", "candidate"):
            version = getattr(model, field)
            if version:
                check_served_id(f"{model.model}{model_ids.SEPARATOR}{version}", field)
        for field in ("configured_percent", "candidate_percent", "shadow_percent"):
            check_number(getattr(model, field), field, high=100.0)
        check_chars(model.rollback_reason, "rollback_reason", MAX_MESSAGE_CHARS)
        check_window(model.stable_window, "stable_window")
        check_window(model.candidate_window, "candidate_window")
    return status


def check_window(window: VersionWindow, what: str) -> None:
    if window.errors > window.replies:
        raise Invalid("out_of_range", f"{what}: {window.errors} errors of {window.replies} replies")
    check_number(window.ttft_p95_s, f"{what}.ttft_p95_s", high=MAX_TTFT_S)


def reply_outcome(data: bytes) -> ReplyOutcome:
    outcome = decoded(data, ReplyOutcome)
    check_id(outcome.reply_id, "reply_id")
    check_served_id(outcome.model, "model")
    check_number(outcome.ttft_s, "ttft_s", high=MAX_TTFT_S)
    return outcome


def check_served_id(value: str, what: str) -> None:
    """A served model id: a name, or name@version with a version model_ids accepts."""
    if not value:
        raise Invalid("bad_id", f"{what} is empty")
    check_chars(value, what, MAX_NAME_CHARS)
    name, version = model_ids.split(value)
    if not name:
        raise Invalid("bad_id", f"{what} {value!r} has no name")
    if version:
        try:
            model_ids.versioned(name, version)
        except ValueError as exc:
            raise Invalid("bad_id", f"{what}: {exc}") from None
