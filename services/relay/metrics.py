"""The relay's own Prometheus metrics."""

from prometheus_client import Counter

EVENTS_LOGGED = Counter("tandem_relay_events_logged_total", "Token events appended to a reply's log")
EVENTS_DROPPED = Counter("tandem_relay_events_dropped_total", "Token events already logged or after the final one", ["why"])
REPLIES_FINISHED = Counter("tandem_relay_replies_finished_total", "Replies whose final event was logged", ["status"])
REPLIES_UNPERSISTED = Counter("tandem_relay_replies_unpersisted_total", "Finished replies the store could not take at once")
IDLE_CANCELS = Counter("tandem_relay_idle_cancels_total", "Replies cancelled because nobody read them")
GAPS_REPORTED = Counter("tandem_relay_gaps_reported_total", "Sweeps that found a log waiting on a missing event")
