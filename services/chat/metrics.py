"""The chat service's own Prometheus metrics."""

from prometheus_client import Counter, Gauge, Histogram

from tandem import model_ids

REPLIES_STARTED = Counter("tandem_chat_replies_started_total", "Replies the router accepted", ["api", "tier"])
REPLIES_REFUSED = Counter("tandem_chat_replies_refused_total", "Replies refused before streaming", ["code"])
API_KEYS_REFUSED = Counter(
    "tandem_chat_api_keys_refused_total",
    "Requests refused at the key check: wrong (a key no line matches) or throttled (an address past its wrong keys, 429)",
    ["reason"],
)
STREAMS_OPEN = Gauge("tandem_chat_streams_open", "SSE streams and OpenAI completions (streamed or not) being served now")
STREAMS_REFUSED = Counter("tandem_chat_streams_refused_total", "New streams refused at a limit", ["code"])
STREAMS_DROPPED = Counter("tandem_chat_streams_dropped_total", "Streams ended for a client too far behind (it resumes)")
FEEDS_ACTIVE = Gauge("tandem_chat_feeds_active", "Replies this instance reads, one feed each, whatever its number of streams")
READER_CONNECTIONS = Gauge("tandem_chat_stream_reader_connections", "Redis connections reading token logs (blocking XREAD)")
GENERATE_RESENT = Counter(
    "tandem_chat_generate_resent_total", "Generate requests sent again because no router was subscribed (one restarting)"
)
STREAM_PASS_SECONDS = Histogram(
    "tandem_chat_stream_pass_seconds",
    "A feed passing a reply's new events to all its streams (written to those waiting, the others woken): one pass's time",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5),
)
STREAM_WRITE_DELAY = Histogram(
    "tandem_chat_stream_write_delay_seconds",
    "From a worker producing a token (its produced_unix_ms) to this instance's feed passing it to all the reply's streams; one per pass, its oldest event",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
STREAM_ATTACHES = Counter(
    "tandem_chat_stream_attaches_total",
    "New streams of a reply by where their meta came from: feed (a reply this instance reads), shared (another stream's read under way), read (a Redis read of their own)",
    ["source"],
)
STREAM_ATTACH_WAITING = Gauge(
    "tandem_chat_stream_attach_waiting",
    "New streams' Redis reads waiting their turn in the attach queue (TANDEM_STREAM_ATTACH_QUEUE bounds it)",
)
STREAM_RESUMES = Counter("tandem_chat_stream_resumes_total", "Streams resumed with Last-Event-ID > 0")
STREAM_DIRECT_WRITES = Counter(
    "tandem_chat_stream_direct_writes_total",
    "Chunks of live events a reply's feed wrote straight to a waiting stream's connection (one per stream and delivery)",
)
SUMMARIES = Counter("tandem_chat_summaries_total", "Conversation summary jobs by outcome: written, refused, failed, skipped", ["outcome"])
IDEMPOTENT_REPEATS = Counter(
    "tandem_chat_idempotent_repeats_total", "Requests that attached to the reply of an earlier one with the same key"
)

# As clients see them (services.chat.latency): from a request's arrival at chat, by the user's tier
# and the served model's name and version (model_labels).
_REPLY = ["tier", "model", "version"]
TIME_TO_FIRST_TOKEN = Histogram(
    "tandem_chat_time_to_first_token_seconds",
    "From a request's arrival at chat to the first content written to its client (streamed replies)",
    _REPLY,
    buckets=(0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 7.5, 10, 20, 30, 60),
)
INTER_TOKEN_LATENCY = Histogram(
    "tandem_chat_inter_token_latency_seconds",
    "Between two writes of content to a streaming client (events written together count once)",
    _REPLY,
    buckets=(0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5),
)
# A streamed reply's longest wait between writes after its first content (to its final event, or
# to the response's end): the stream-pause SLI (deploy/prometheus/alerts.yml counts those over 2 s).
LONGEST_PAUSE = Histogram(
    "tandem_chat_stream_longest_pause_seconds",
    "A streamed reply's longest wait between two writes to its client after the first content, once it ends",
    _REPLY,
    buckets=(0.1, 0.25, 0.5, 1, 2, 3, 5, 10, 30, 60),
)
E2E_LATENCY = Histogram(
    "tandem_chat_e2e_latency_seconds",
    "From a request's arrival at chat to its reply's final event written to the client (streamed or whole)",
    _REPLY,
    buckets=(0.25, 0.5, 1, 2, 3, 5, 7.5, 10, 15, 20, 30, 45, 60, 120, 300),
)
REPLIES = Counter(
    "tandem_chat_replies_total",
    "Replies started by a request, by how they ended for its client: done, cancelled, failed, moderated, expired, client_gone",
    ["outcome", *_REPLY],
)
PROMPT_TOKENS = Counter("tandem_chat_prompt_tokens_total", "Prompt tokens of replies that ended (final usage)", _REPLY)
CACHED_TOKENS = Counter("tandem_chat_cached_tokens_total", "Of the prompt tokens, those served by a prefix cache", _REPLY)
OUTPUT_TOKENS = Counter("tandem_chat_output_tokens_total", "Output tokens of replies that ended", _REPLY)

# Refusals by the safety checks, watched as closely as errors: `direction` input (the user's
# message, refused before anything starts) or output (an answer retracted mid-stream).
MODERATED = Counter("tandem_chat_moderated_total", "Messages or answers the safety checks refused", ["direction", "tier", "model"])
INPUT_CHECK_SECONDS = Histogram(
    "tandem_chat_input_check_seconds",
    "The input check's time on one message (it runs while the prompt is built)",
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)

# Which model answers a message (services.chat.model_routing): by the model chosen and who decided.
MODEL_ROUTES = Counter(
    "tandem_chat_model_routes_total",
    "Messages routed to a model, by who decided: classifier, fallback, user, conversation, single_model, quota_fallback (a second decision)",
    ["model", "decided_by"],
)
DIFFICULTY_SCORES = Histogram(
    "tandem_chat_difficulty_score",
    "The difficulty classifier's scores (0 easy to 1 hard) of the messages it decided",
    buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
)
DIFFICULTY_FALLBACKS = Counter(
    "tandem_chat_difficulty_fallbacks_total",
    "Messages the fallback rule routed because the classifier gave no score: none, error, timeout, busy",
    ["reason"],
)

# What users make of the answers, by the model version that wrote them (model_labels): their
# ratings (POST /v1/messages/{id}/feedback), and the regenerate rate, regenerations over answers.
_VERSIONED = ["model", "version"]
FEEDBACK = Counter(
    "tandem_feedback_total", "Answers rated by their users (a rating given again counts only when its vote changes)", [*_VERSIONED, "vote"]
)
ANSWERS = Counter("tandem_answers_total", "Answers started for the product API's messages and regenerations", _VERSIONED)
REGENERATIONS = Counter("tandem_regenerations_total", "Answers regenerated, by the model version of the answer replaced", _VERSIONED)
SHADOW_REPLIES = Counter(
    "tandem_chat_shadow_replies_total",
    "Shadow replies the rollout mirrored to a candidate version, by outcome: started, refused (by the router), failed (not asked)",
    [*_VERSIONED, "outcome"],
)


def model_labels(served_model: str) -> dict[str, str]:
    """`name@version` -> {"model": name, "version": version}; a name without `@` has version ""."""
    name, version = model_ids.split(served_model)
    return {"model": name, "version": version}
