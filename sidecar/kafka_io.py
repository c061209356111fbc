"""Small helpers for the Kafka edge that the intake and the log reader share."""

import logging
import math
import re
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import Consumer, KafkaError, Message

# Some brokers (noida-db among them) answer a fetch with more than fetch.max.bytes; librdkafka
# then rejects the response ("Invalid response size") and retries forever. Accept up to 512 MiB,
# and bound what is queued in memory per partition instead. Apache Kafka does not need this: it
# read a 40 MB partition to a consumer that takes at most 2 MiB a response (fetch.max.bytes 1 MiB);
# kept for the fallback broker, noida-db, which answered that consumer with all 40 MB at once.
#
# A partition fetches again only once the loop has taken everything fetched before (checked every
# millisecond). By default librdkafka fetches until 100,000 records are queued, and a broker that
# answers at once (noida-db ignores fetch.wait.max.ms and fetch.min.bytes) then answers thousands
# of fetches a second of a record or two each while the loop is busy: 124,000 fetches in a burst
# of 90,000 nacks, 4.4 s of the consumer's thread, against 530 and 0.5 s like this, and a burst's
# drain took 24 to 28 s instead of 16 to 17 (measured 2026-11-26). Apache Kafka needs it too: a
# held fetch returns at the first record written, so a consumer taking 10,000 records every 50 ms
# from 4 partitions written at 40,000 records a second made 2,520 to 2,740 fetches in 12 s with
# librdkafka's defaults, 190 to 210 like this. A broker that holds fetches loses at most a
# millisecond a fetch.
CONSUMER_DEFAULTS: dict[str, Any] = {
    "receive.message.max.bytes": 512 * 1024 * 1024,
    "queued.max.messages.kbytes": 32 * 1024,
    "fetch.wait.max.ms": 10,
    "queued.min.messages": 1,
    "fetch.queue.backoff.ms": 1,
    # A subscribed topic that the cluster did not know yet at the last metadata refresh (one just
    # created, or re-created) is assigned at the next refresh: 10 s, not librdkafka's 5 minutes.
    "topic.metadata.refresh.interval.ms": 10_000,
}


# A repeated client error (a broker that refuses connections, every 50 ms) is logged once, then
# once a minute with the count of lines held back.
REPEAT_WINDOW_S = 60.0
_VARYING = re.compile(r"\d+(ms)?")


class RepeatFilter(logging.Filter):
    def __init__(self, window_s: float = REPEAT_WINDOW_S) -> None:
        super().__init__()
        self._window_s = window_s
        self._seen: dict[str, tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = _VARYING.sub("#", record.getMessage())
        now = time.monotonic()
        first, held = self._seen.get(key, (0.0, 0))
        if now - first < self._window_s:
            self._seen[key] = (first, held + 1)
            return False
        if len(self._seen) > 1_000:
            self._seen.clear()
        self._seen[key] = (now, 0)
        if held:
            record.msg, record.args = f"{record.getMessage()} repeated={held}", None
        return True


logger = logging.getLogger(__name__)
LIBRDKAFKA = logging.getLogger("librdkafka")
"""Every Kafka client the sidecar opens logs here, in the key=value format, repeats held back."""
LIBRDKAFKA.addFilter(RepeatFilter())


def is_fatal(error: KafkaError) -> bool:
    """A client that failed for good. A consumer hands its fatal error to `consume` as an event of
    code _FATAL whose `fatal()` is False (the flag travels only with rd_kafka_fatal_error): a static
    member that another took the place of (FENCED_INSTANCE_ID) came back that way, and went on
    delivering and committing as a zombie."""
    return bool(error.fatal()) or error.code() == KafkaError._FATAL


def consumer_config(client_config: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    """Settings of every consumer the sidecar opens: the shared defaults, the client's, then its own."""
    return {**CONSUMER_DEFAULTS, **client_config, **overrides}


def log_reader(client_config: dict[str, Any], group_id: str, **overrides: Any) -> Consumer:
    """A consumer of partitions it assigns itself, for reading the log rather than following it.

    It never commits: `group_id` only satisfies the client, and positions come from the caller. It
    reports each partition's end, and an offset deleted by retention reads from the log start, so
    the caller finds what is gone instead of failing.
    """
    settings = {
        "group.id": group_id,
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "enable.partition.eof": True,
        "auto.offset.reset": "earliest",
        **overrides,
    }
    return Consumer(consumer_config(client_config, **settings), logger=LIBRDKAFKA)


def poll_timeout_s(wait_s: float) -> float:
    """`wait_s` rounded up to whole milliseconds, for a timeout librdkafka takes in them.

    confluent-kafka truncates a timeout to milliseconds, so a wait under one returned at once, and
    the loop turned again and again until the instant it waited for: an idle sidecar pacing its
    partitions (inbound/idle_fetch.py) spun through each resume's last millisecond, 1,000 to 1,600
    turns a second. On one Apache Kafka node with two inbound and three control partitions, an idle
    sidecar's first 25 to 60 s cost it 0.10 to 0.12 of a core, and 0.075 to 0.09 since (2026-12-02;
    the rest is the pacing's cycle, idle_fetch.py). The half millisecond keeps a whole number of
    them whole through the float product that is truncated.
    """
    return (math.ceil(wait_s * 1000) + 0.5) / 1000


def consume_batch(consumer: Consumer, max_records: int, wait_s: float) -> list[Message]:
    """What is buffered, at once; otherwise wait until one record arrives or wait_s passes.

    Consumer.consume(n, timeout) blocks for the whole timeout unless n records arrive, which would
    add up to `timeout` of lateness to every delivery; poll() returns at the first record.
    """
    records: list[Message] = consumer.consume(max_records, 0)
    if records or wait_s <= 0:
        return records
    first = consumer.poll(poll_timeout_s(wait_s))
    if first is None:
        return []
    return [first, *consumer.consume(max_records - 1, 0)]


# Not _TRANSPORT: librdkafka reports it for one broker's connection, and one broker of several away
# is no outage (the cluster serves its partitions from the others). Counted as one, it aborted every
# exactly-once transaction while a node was down: in a rolling restart of three nodes an engine
# started again 21 times, each new client failing on the down node's bootstrap address. With every
# broker away librdkafka says _ALL_BROKERS_DOWN ("1/1 brokers are down" on a single node).
_UNREACHABLE = {
    KafkaError._ALL_BROKERS_DOWN,
    KafkaError._RESOLVE,
    KafkaError._AUTHENTICATION,
    KafkaError._SSL,
}


# librdkafka also reports "0/2 brokers are down" while it moves from the bootstrap address to the
# brokers it learned of: nothing is down then.
_NONE_DOWN = re.compile(r"0/\d+ brokers are down")


class Connectivity:
    """Whether the cluster answers, as the clients report it, for /healthz and one log line per change.

    librdkafka reports losing the brokers (error_cb) but not finding them again, so while they are
    away the loop asks for metadata (`watch`), and the first answer clears the state. Records
    consumed are no proof: they may have been fetched before the brokers went, or be the consumer's
    own error events. They only make the next question come sooner.
    """

    PROBE_EVERY_S = 2.0
    PROBE_ON_RECORDS_S = 0.25
    UNACKNOWLEDGED_S = 15.0

    def __init__(self) -> None:
        self.reason: str | None = None
        self.outages = 0
        """How many times the brokers were lost: an exactly-once transaction that spans one is not committed."""
        self._down_since = 0.0
        self._probed = 0.0
        self._put_off_since: float | None = None
        """When checkpoints began to be put off (`acknowledging`), time.monotonic."""

    def on_error(self, error: KafkaError) -> None:
        """The clients' error_cb: runs on the loop's thread, inside poll and consume."""
        if error.code() in _UNREACHABLE and self.reason is None and not _NONE_DOWN.match(error.str()):
            self.reason = f"Kafka unreachable: {error.str()}"
            self.outages += 1
            self._down_since = time.monotonic()
            logger.warning("brokers unreachable error=%s", error.str())

    def acknowledging(self, put_off: bool) -> None:
        """After each checkpoint: whether it was put off because the brokers did not acknowledge its
        records or its commit. Unlike `reason`, a metadata answer does not end this: with two
        nodes of three away, the third answers metadata but takes no write (min.insync.replicas)."""
        if put_off and self._put_off_since is None:
            self._put_off_since = time.monotonic()
            logger.warning("checkpoints put off: the brokers do not acknowledge writes or commits")
        elif not put_off and self._put_off_since is not None:
            logger.info("checkpoints committed again after_s=%.1f", time.monotonic() - self._put_off_since)
            self._put_off_since = None

    @property
    def unacknowledged(self) -> str | None:
        """Why /healthz is 503 once checkpoints have been put off for UNACKNOWLEDGED_S: a leader that
        moves holds writes for a few seconds (one node of three away is not an outage)."""
        since = self._put_off_since
        if since is None or time.monotonic() - since < self.UNACKNOWLEDGED_S:
            return None
        return f"Kafka not acknowledging: checkpoints put off for {time.monotonic() - since:.0f} s"

    def watch(self, consumed: bool, answers: Callable[[], bool]) -> None:
        """Once a loop turn: while the brokers are away, ask `answers` (a metadata request) every
        PROBE_EVERY_S, or after PROBE_ON_RECORDS_S when the turn `consumed` records."""
        if self.reason is None:
            return
        since = time.monotonic() - self._probed
        if since < (self.PROBE_ON_RECORDS_S if consumed else self.PROBE_EVERY_S):
            return
        self._probed = time.monotonic()
        if answers():
            self.up()

    def up(self) -> None:
        if self.reason is not None:
            logger.info("brokers reachable again after_s=%.1f", time.monotonic() - self._down_since)
            self.reason = None
