"""What a finished reply adds to the usage ledger (tandem.store.usage), read from what the relay
already holds when it stores the reply: its meta (the user, the model asked for, when its log
closed, the request) and its logged final event (the served model and the usage the reply
reported to its client, the product API's `done` and OpenAI's `usage` alike).

A final event without usage (an error, or an end the relay wrote) counts its prompt and the
tokens delivered before it, as the quota settlement charges it (services/relay/quotas.py)."""

from __future__ import annotations

from tandem.bus.events import now_ms
from tandem.store import ReplyUsage
from tandem.store.usage import utc_day
from tandem.tokenlog import ReplyMeta
from tandem.v1.common_pb2 import LANE_BACKGROUND
from tandem.v1.generate_pb2 import GenerateRequest
from tandem.v1.tokens_pb2 import TokenEvent


def reply_usage(meta: ReplyMeta, final: TokenEvent) -> ReplyUsage | None:
    """None for a reply no user is billed for: a bus client's (no user), background work the
    service did on its own account (a conversation's summary), or a shadow (a rollout's candidate
    answering a mirrored request, in the background lane too)."""
    request = GenerateRequest.FromString(meta.request)
    if not meta.user_id or request.lane == LANE_BACKGROUND or request.shadow_of:
        return None
    usage = final.usage
    if usage.input_tokens or usage.output_tokens:
        num_prompt, num_cached, num_completion = usage.input_tokens, min(usage.cached_tokens, usage.input_tokens), usage.output_tokens
    else:
        num_prompt, num_cached, num_completion = len(request.prompt_token_ids), 0, max(0, final.seq - 1)
    return ReplyUsage(
        reply_id=meta.reply_id,
        user_id=meta.user_id,
        model=final.model or meta.model,  # the worker's final names the served model; one the relay wrote does not
        day=utc_day(meta.finished_ms or now_ms()),  # fixed when the log closed, so every retry counts on the same day
        prompt_tokens=num_prompt,
        cached_tokens=num_cached,
        completion_tokens=num_completion,
    )
