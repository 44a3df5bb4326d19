"""The chat service's own Prometheus metrics."""

from prometheus_client import Counter, Gauge

REPLIES_STARTED = Counter("tandem_chat_replies_started_total", "Replies the router accepted", ["api", "tier"])
REPLIES_REFUSED = Counter("tandem_chat_replies_refused_total", "Replies refused before streaming", ["code"])
STREAMS_OPEN = Gauge("tandem_chat_streams_open", "SSE streams being served now")
STREAMS_REFUSED = Counter("tandem_chat_streams_refused_total", "New streams refused at a limit", ["code"])
STREAMS_DROPPED = Counter("tandem_chat_streams_dropped_total", "Streams ended for a client too far behind (it resumes)")
FEEDS_ACTIVE = Gauge("tandem_chat_feeds_active", "Replies this instance reads, one feed each, whatever its number of streams")
READER_CONNECTIONS = Gauge("tandem_chat_stream_reader_connections", "Redis connections reading token logs (blocking XREAD)")
STREAM_RESUMES = Counter("tandem_chat_stream_resumes_total", "Streams resumed with Last-Event-ID > 0")
IDEMPOTENT_REPEATS = Counter(
    "tandem_chat_idempotent_repeats_total", "Requests that attached to the reply of an earlier one with the same key"
)
