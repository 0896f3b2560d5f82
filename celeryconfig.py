"""Celery configuration, derived from the validated ``REAPER_*`` settings.

Loaded by ``reaper.celery_app``; an invalid environment stops the worker here,
with one line naming the variable.
"""

from kombu.entity import Queue

from reaper import budgets
from reaper.broker import install as install_broker_transport
from reaper.broker import ssl_options as broker_ssl_options
from reaper.broker import transport_options
from reaper.config import get_settings

_settings = get_settings()
_interval = _settings.polling_interval.total_seconds()
_lock_ttl = _settings.lock_ttl.total_seconds()
_relay_interval = _settings.relay_interval.total_seconds()
# A stop pass sends for budgets.stop_pass, then marks what it sent; the limits
# bound one stuck on its database.
_stop_soft_limit = budgets.stop_pass_give_up(_settings).total_seconds() + 10
# Retries of stop signals not taken: the first back-off is 5 recorder timeouts,
# so ticking about that often sends each when it is due.
_stop_interval = max(5.0, 5 * _settings.recorder_timeout.total_seconds())
# A relay pass stops claiming at relay_max_pass_duration; the two batches in
# flight then settle within a few Kafka timeouts (rounds, metadata, acks).
_relay_soft_limit = (
    _settings.relay_max_pass_duration.total_seconds()
    + 4 * _settings.kafka_timeout.total_seconds()
    + 10
)

broker_url = _settings.broker_url
# kombu's Redis transport with the repair of reaper/broker.py: a Redis restart
# under a busy worker would otherwise end the worker (Celery/kombu 5.7).
install_broker_transport()
broker_connection_retry_on_startup = True
# rediss://: the Redis server's certificate is verified, host name included,
# against REAPER_BROKER_SSL_CAFILE (reaper/broker.py); the worker, its beat, every
# sender, `celery call` and Flower read it here.
broker_use_ssl = broker_ssl_options(_settings)
broker_transport_options = {
    # Above queue wait + the longest time limit; a redelivered reap is harmless.
    "visibility_timeout": 3600,
    # Connect and socket timeouts, keepalive, health checks: a silent Redis
    # never holds the worker, its beat or a task's send (reaper/broker.py).
    **transport_options(_settings),
    **({"global_keyprefix": _settings.broker_key_prefix} if _settings.broker_key_prefix else {}),
}

# Redis is the broker and nothing else: no result backend, no state.
result_backend = None
task_ignore_result = True

# JSON only: a pickled message is rejected, never deserialised.
task_serializer = "json"
result_serializer = "json"
accept_content = ["json"]
event_serializer = "json"

# Flower follows tasks through events.
worker_send_task_events = True
task_send_sent_event = True

worker_prefetch_multiplier = 1
worker_hijack_root_logger = False
timezone = "UTC"
enable_utc = True

task_default_queue = "reaper"
# The relay and the recorder stop signals have their own queues so a Kafka or
# recorder outage never queues up in front of a reap cycle; `celery -A reaper
# worker` consumes all three (task_queues).
task_queues = (
    Queue("reaper", routing_key="reaper"),
    Queue("reaper.relay", routing_key="reaper.relay"),
    Queue("reaper.recorder", routing_key="reaper.recorder"),
)
task_routes = {
    "reaper.reap": {"queue": "reaper"},
    "reaper.reap_phase": {"queue": "reaper"},
    "reaper.relay_outbox": {"queue": "reaper.relay"},
    "reaper.stop_recordings": {"queue": "reaper.recorder"},
}

task_annotations = {
    # A phase ends itself at the cycle's deadline; these bound a stuck one.
    # statement_timeout (MaxRunDuration) fires well before the soft limit.
    "reaper.reap_phase": {"soft_time_limit": _lock_ttl, "time_limit": _lock_ttl + 15},
    "reaper.reap": {"soft_time_limit": 30, "time_limit": 45},
    "reaper.relay_outbox": {
        "soft_time_limit": _relay_soft_limit,
        "time_limit": _relay_soft_limit + 15,
    },
    "reaper.stop_recordings": {
        "soft_time_limit": _stop_soft_limit,
        "time_limit": _stop_soft_limit + 15,
    },
}

beat_schedule = {
    "reap": {
        "task": "reaper.reap",
        "schedule": _interval,
        # A tick nobody picked up in time is dropped, never replayed in a burst.
        "options": {"expires": max(1.0, _interval * 0.9)},
    },
    "relay-outbox": {
        "task": "reaper.relay_outbox",
        "schedule": _relay_interval,
        "options": {"expires": max(1.0, _relay_interval * 0.9)},
    },
}
if _settings.recorder_url:
    beat_schedule["stop-recordings"] = {
        "task": "reaper.stop_recordings",
        "schedule": _stop_interval,
        "options": {"expires": max(1.0, _stop_interval * 0.9)},
    }
