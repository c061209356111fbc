"""The writer reads from librdkafka's own statistics whether its idempotent producer has an id.

A producer without one sends nothing: after a broker restart librdkafka once left it so for good
(checkpoint.py replaces such a writer). Both sides against the real client: a producer that cannot
reach any broker has none, and one on the run's broker gets one.
"""

import logging

from sidecar.broker.ports import free_port
from sidecar.outbound.writer import Writer
from tests.fake_clock import MonotonicClock
from tests.kafka_helpers import TopicFactory, wait_for

FAST_STATS = {"statistics.interval.ms": 100}
LOG = logging.getLogger("librdkafka")


def _stats_seen(writer: Writer) -> bool:
    writer.poll()
    return writer.id_state != "Init"


def test_a_producer_that_reaches_no_broker_is_without_an_id_for_as_long_as_it_runs() -> None:
    clock = MonotonicClock(50.0)
    writer = Writer({"bootstrap.servers": f"127.0.0.1:{free_port()}"}, LOG, tuning=FAST_STATS, clock=clock)
    try:
        writer.send("anywhere", None, b"v", [])
        wait_for(lambda: _stats_seen(writer), 30, "the producer's statistics")
        assert writer.id_state != "Assigned"
        assert "brokers=none waiting=anywhere/-1@-1:1" in writer.describe()  # unknown topic: partition -1
        clock.now += 40
        assert writer.without_id_s() == 40
    finally:
        writer.close(clean=False)


def test_a_producer_on_a_broker_has_an_id(kafka: str, topic_factory: TopicFactory) -> None:
    clock = MonotonicClock(50.0)
    writer = Writer({"bootstrap.servers": kafka}, LOG, tuning=FAST_STATS, clock=clock)
    try:
        writer.send(topic_factory("writer-id"), None, b"v", [])
        assert writer.acknowledged(60)
        wait_for(lambda: _stats_seen(writer) and writer.id_state == "Assigned", 30, "an id in the statistics")
        clock.now += 40
        assert writer.without_id_s() == 0
        described = writer.describe()
        assert described.startswith("id_state=Assigned brokers=") and ":UP" in described, described
    finally:
        writer.close()
