"""The relay's own Prometheus metrics."""

from prometheus_client import Counter, Gauge, Histogram

EVENTS_LOGGED = Counter("tandem_relay_events_logged_total", "Token events appended to a reply's log")
EVENTS_DROPPED = Counter(
    "tandem_relay_events_dropped_total", "Token events not logged: already logged or after the final one, held, stale or bad", ["why"]
)
EVENTS_RETRIED = Counter("tandem_relay_events_retried_total", "Token events handed back to the stream because the log could not take them")
REPLIES_FINISHED = Counter("tandem_relay_replies_finished_total", "Replies whose final event was logged", ["status"])
REPLIES_UNPERSISTED = Counter("tandem_relay_replies_unpersisted_total", "Finished replies the store could not take at once")
IDLE_CANCELS = Counter("tandem_relay_idle_cancels_total", "Replies cancelled because nobody read them")
GAPS_REPORTED = Counter("tandem_relay_gaps_reported_total", "Sweeps that found a log waiting on a missing event")
STALLS = Counter("tandem_relay_stalls_total", "Running replies found stalled: no progress and no live worker claiming them")
CONTINUATIONS = Counter("tandem_relay_continuations_total", "Stalled replies resubmitted to the router", ["outcome"])
REPLIES_LOST = Counter("tandem_relay_replies_lost_total", "Stalled replies ended with an error after their last continuation")
WORKERS_GONE = Counter("tandem_relay_workers_gone_total", "Workers a ping found gone (no responders): their replies continue at once")
OUTCOMES = Counter(
    "tandem_relay_outcomes_total",
    "Finished replies' outcomes for the routers' rollbacks: published, or lost to the bus (failed)",
    ["result"],
)
SHADOW_ANSWERS = Counter("tandem_relay_shadow_answers_total", "Shadow replies' answers stored, by how they ended", ["status"])
REPLIES_WAITING_FOR_STORE = Gauge(
    "tandem_relay_replies_waiting_for_store", "Finished replies not stored yet (their logs kept until they are), at the relay's last count"
)
OLDEST_WAIT_FOR_STORE = Gauge(
    "tandem_relay_oldest_wait_for_store_seconds", "How long the oldest finished reply not stored yet has waited, at the relay's last count"
)
REPLIES_GIVEN_UP = Counter(
    "tandem_relay_replies_given_up_total", "Finished replies given up on after waiting for the store past TANDEM_UNSTORED_REPLY_MAX_WAIT_S"
)
REDIS_USED_MEMORY = Gauge(
    "tandem_relay_redis_used_memory_bytes", "Memory the Redis of the token logs and quotas uses, at the relay's last reading"
)
REDIS_MAXMEMORY = Gauge("tandem_relay_redis_maxmemory_bytes", "That Redis's maxmemory limit (0: none), at the relay's last reading")
REDIS_MAY_EVICT = Gauge(
    "tandem_relay_redis_may_evict", "1 when that Redis's maxmemory-policy may drop keys (anything but noeviction), else 0"
)
PERSIST_RETRIES = Counter("tandem_relay_persist_retries_total", "Tries by a sweep to store a finished reply the store did not take at once")
MODERATED = Counter(
    "tandem_relay_moderated_total", "Replies the output check ended as moderated while they streamed", ["direction", "tier", "model"]
)
OUTPUT_CHECK_SECONDS = Histogram(
    "tandem_relay_output_check_seconds",
    "Seconds one call of the output check took (the windows due at once, scored together on the check's thread)",
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0),
)
