"""sidecar.client against the contract (sections 1, 4 and 5), with fakes in place of a broker."""

import importlib.util
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from sidecar.client import (
    CONTROL_TOPIC,
    MessageId,
    NackDeliveryError,
    Nacker,
    backoff_delay,
    delay_headers,
    deliver_at,
    origin,
    outbound_consumer_config,
    redelivery_count,
)
from sidecar.outbound.records import outbound_headers

Headers = list[tuple[str, bytes | None]] | None


@dataclass
class FakeMessage:
    """What a consumer hands over: the accessors of confluent_kafka.Message."""

    _headers: Headers = None
    _topic: str = "payments.orders.billing"
    _partition: int = 0
    _offset: int = 0
    _value: bytes | None = b"order"
    _key: bytes | None = b"order-1"

    def headers(self) -> Headers:
        return self._headers

    def topic(self) -> str:
        return self._topic

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset

    def value(self) -> bytes | None:
        return self._value

    def key(self) -> bytes | None:
        return self._key

    def error(self) -> None:
        return None


@dataclass
class FakeProducer:
    """Records produce() calls; flush() reports each one delivered, or failed with `error`."""

    calls: list[dict[str, Any]] = field(default_factory=list)
    error: object = None
    pending: list[Callable[[Any, Any], None]] = field(default_factory=list)

    def produce(self, topic: str, value: bytes | None = None, key: bytes | None = None, **kwargs: Any) -> None:
        self.calls.append({"topic": topic, "value": value, "key": key, **kwargs})
        if kwargs.get("on_delivery") is not None:
            self.pending.append(kwargs["on_delivery"])

    def flush(self, timeout: float = -1) -> int:
        pending, self.pending = self.pending, []
        for callback in pending:
            callback(self.error, None)
        return 0


def outbound(
    topic: str = "payments.orders", partition: int = 3, offset: int = 1234, count: int = 0, at: int = 1_700_000_000_000
) -> FakeMessage:
    """An outbound record in the v1 header form of contract section 4, after the producer's own headers."""
    return FakeMessage(
        [
            ("trace-id", b"abc"),
            ("delay-origin-topic", topic.encode()),
            ("delay-origin-partition", str(partition).encode()),
            ("delay-origin-offset", str(offset).encode()),
            ("delay-deliver-at", str(at).encode()),
            ("delay-redelivery-count", str(count).encode()),
        ],
        _offset=77,
    )


def sent_command(producer: FakeProducer, index: int = -1) -> dict[str, Any]:
    value = producer.calls[index]["value"]
    assert isinstance(value, bytes)
    command = json.loads(value)
    assert isinstance(command, dict)
    return command


# --- delay_headers (contract section 1) --------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"deliver_at": 1_763_719_200_000}, ("deliver-at", b"1763719200000")),
        ({"deliver_at": 0}, ("deliver-at", b"0")),
        ({"deliver_at": datetime(2025, 11, 21, 10, 0, tzinfo=UTC)}, ("deliver-at", b"1763719200000")),
        (
            {"deliver_at": datetime(2025, 11, 21, 11, 0, 0, 123_999, tzinfo=timezone(timedelta(hours=1)))},
            ("deliver-at", b"1763719200123"),
        ),
        ({"deliver_after": 1500}, ("deliver-after", b"1500")),
        ({"deliver_after": 0}, ("deliver-after", b"0")),
        ({"deliver_after": timedelta(minutes=5)}, ("deliver-after", b"300000")),
        ({"deliver_after": timedelta(milliseconds=2, microseconds=999)}, ("deliver-after", b"2")),
        ({"deliver_after": "1500"}, ("deliver-after", b"1500")),
        ({"deliver_after": "250ms"}, ("deliver-after", b"250ms")),
        ({"deliver_after": "30s"}, ("deliver-after", b"30s")),
        ({"deliver_after": "5m"}, ("deliver-after", b"5m")),
        ({"deliver_after": "2h"}, ("deliver-after", b"2h")),
        ({"deliver_after": "7d"}, ("deliver-after", b"7d")),
    ],
)
def test_delay_headers_forms(kwargs: dict[str, Any], expected: tuple[str, bytes]) -> None:
    headers = delay_headers(**kwargs)
    assert headers == [expected]
    assert headers[0][1].decode("ascii")  # the contract asks for ASCII values


@pytest.mark.parametrize("kwargs", [{}, {"deliver_at": 1, "deliver_after": 1}, {"deliver_at": None}])
def test_delay_headers_needs_exactly_one(kwargs: dict[str, Any]) -> None:
    with pytest.raises(TypeError, match="exactly one"):
        delay_headers(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"deliver_at": -1}, ValueError, "before 1970"),
        ({"deliver_at": datetime(1969, 12, 31, tzinfo=UTC)}, ValueError, "before 1970"),
        ({"deliver_at": datetime(2026, 1, 1)}, ValueError, "no timezone"),
        ({"deliver_at": 1.5}, TypeError, "epoch milliseconds"),
        ({"deliver_at": True}, TypeError, "epoch milliseconds"),
        ({"deliver_at": "2026-11-21T10:00:00Z"}, TypeError, "epoch milliseconds"),
        ({"deliver_after": -1}, ValueError, "negative"),
        ({"deliver_after": timedelta(seconds=-1)}, ValueError, "negative"),
        ({"deliver_after": "-30s"}, ValueError, "negative"),
        ({"deliver_after": 2.5}, TypeError, "milliseconds"),
        ({"deliver_after": False}, TypeError, "milliseconds"),
        ({"deliver_after": ""}, ValueError, "not a duration"),
        ({"deliver_after": "30 s"}, ValueError, "not a duration"),
        ({"deliver_after": " 30s"}, ValueError, "not a duration"),
        ({"deliver_after": "30S"}, ValueError, "not a duration"),
        ({"deliver_after": "1.5s"}, ValueError, "not a duration"),
        ({"deliver_after": "5w"}, ValueError, "not a duration"),
        ({"deliver_after": "ms"}, ValueError, "not a duration"),
        ({"deliver_after": "PT30S"}, ValueError, "not a duration"),
        ({"deliver_after": "+30s"}, ValueError, "not a duration"),
        ({"deliver_after": "３０s"}, ValueError, "not a duration"),  # noqa: RUF001 - full-width digits
    ],
)
def test_delay_headers_rejects(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        delay_headers(**kwargs)


# --- reading outbound records (contract section 4) ------------------------------------------------------


def test_origin_redelivery_count_and_deliver_at_round_trip() -> None:
    record = outbound(topic="payments.orders", partition=3, offset=1234, count=2, at=1_763_719_200_000)
    assert origin(record) == MessageId("payments.orders", 3, 1234)
    assert str(origin(record)) == "payments.orders/3/1234"
    assert redelivery_count(record) == 2
    assert deliver_at(record) == 1_763_719_200_000


def test_message_id_is_frozen_and_hashable() -> None:
    message_id = MessageId("t", 0, 1)
    assert {message_id: 1}[MessageId("t", 0, 1)] == 1
    with pytest.raises(AttributeError):
        message_id.offset = 2  # type: ignore[misc]


def test_last_occurrence_of_a_header_wins() -> None:
    """A record delayed twice carries the first sidecar's headers among its originals, then ours."""
    record = outbound(topic="new", partition=1, offset=5)
    assert record._headers is not None
    record._headers[:0] = [("delay-origin-topic", b"old"), ("delay-redelivery-count", b"9")]
    assert origin(record) == MessageId("new", 1, 5)
    assert redelivery_count(record) == 0


def test_str_header_values_are_accepted() -> None:
    record = FakeMessage(
        [("delay-origin-topic", "t"), ("delay-origin-partition", "0"), ("delay-origin-offset", "9")]  # type: ignore[list-item]
    )
    assert origin(record) == MessageId("t", 0, 9)


@pytest.mark.parametrize("headers", [None, [], [("deliver-after", b"30s")]])
def test_record_not_from_the_sidecar(headers: Headers) -> None:
    record = FakeMessage(headers)
    for read in (origin, redelivery_count, deliver_at):
        with pytest.raises(ValueError, match=r"no 'delay-origin' header .*'delay-origin-topic'"):
            read(record)


def compact(topic: str = "payments.orders", partition: int = 3, offset: int = 1234, count: int = 0,
            at: int = 1_700_000_000_000) -> FakeMessage:  # fmt: skip
    """A delivery in the compact header form (the default), as the sidecar writes it."""
    return FakeMessage([("trace-id", b"abc"), *outbound_headers(None, topic, partition, offset, at, count)])


@pytest.mark.parametrize("count", [0, 3])
def test_the_compact_form_reads_as_the_v1_form(count: int) -> None:
    short, long = compact(count=count), outbound(count=count)
    assert short._headers is not None
    assert {name for name, _ in short._headers} - {"trace-id"} == (
        {"delay-origin", "delay-deliver-at"} | ({"delay-redelivery-count"} if count else set())
    )
    for read in (origin, redelivery_count, deliver_at):
        assert read(short) == read(long)
    assert origin(compact(topic="a.b-c_d")) == MessageId("a.b-c_d", 3, 1234)


def test_a_compact_delivery_of_a_record_that_was_delivered_before_reads_its_own_headers() -> None:
    """The first sidecar's headers (either form, a count among them) are originals of the second delivery."""
    for earlier in (outbound(topic="old", count=9), compact(topic="old", count=9)):
        assert earlier._headers is not None
        record = compact(topic="new", partition=1, offset=5)
        assert record._headers is not None
        record._headers[:0] = earlier._headers
        assert (origin(record), redelivery_count(record)) == (MessageId("new", 1, 5), 0)
        again = outbound(topic="new", partition=1, offset=5, count=2)
        assert again._headers is not None
        again._headers[:0] = earlier._headers
        assert (origin(again), redelivery_count(again)) == (MessageId("new", 1, 5), 2)


@pytest.mark.parametrize("value", [b"", b"t", b"t/1", b"/1/2", b"t/x/2", b"t/1/-2", b"t/1/2 ", "é/1/2".encode()])
def test_a_malformed_compact_origin_is_named(value: bytes) -> None:
    record = compact()
    assert record._headers is not None
    record._headers = [(n, value if n == "delay-origin" else v) for n, v in record._headers]
    with pytest.raises(ValueError, match="'delay-origin'"):
        origin(record)


def test_missing_origin_header_is_named() -> None:
    record = outbound()
    assert record._headers is not None
    record._headers = [h for h in record._headers if h[0] != "delay-origin-offset"]
    with pytest.raises(ValueError, match="'delay-origin-offset'"):
        origin(record)


@pytest.mark.parametrize(
    ("name", "value", "match"),
    [
        ("delay-origin-partition", b"-1", "not a non-negative decimal"),
        ("delay-origin-offset", b"12x", "not a non-negative decimal"),
        ("delay-origin-offset", b"", "not a non-negative decimal"),
        ("delay-origin-offset", None, "has no value"),
        ("delay-origin-topic", b"", "is empty"),
        ("delay-origin-topic", "é".encode(), "not ASCII"),
    ],
)
def test_malformed_origin_headers(name: str, value: bytes | None, match: str) -> None:
    record = outbound()
    assert record._headers is not None
    record._headers = [(n, value if n == name else v) for n, v in record._headers]
    with pytest.raises(ValueError, match=match):
        origin(record)


# --- Nacker (contract section 5) -----------------------------------------------------------------------


def test_nack_command_key_and_topic() -> None:
    producer = FakeProducer()
    Nacker(producer).nack(outbound(count=1), 30_000, subscription="billing")
    assert len(producer.calls) == 1
    call = producer.calls[0]
    assert call["topic"] == "delay-sidecar.control" == CONTROL_TOPIC
    assert call["key"] == b"payments.orders/3/1234"
    assert sent_command(producer) == {
        "v": 1,
        "type": "nack",
        "subscription": "billing",
        "topic": "payments.orders",
        "partition": 3,
        "offset": 1234,
        "delay_ms": 30_000,
        "redelivery_count": 1,
    }


def test_nack_command_validates_against_the_contract_fields() -> None:
    """Section 5: v == 1, type "nack", a subscription, the origin, and exactly one of delay_ms / deliver_at."""
    producer = FakeProducer()
    nacker = Nacker(producer, subscription="billing")
    nacker.nack(outbound(), timedelta(seconds=30))
    nacker.nack_at(outbound(), 1_763_719_200_000)
    for command in (sent_command(producer, 0), sent_command(producer, 1)):
        assert command["v"] == 1
        assert command["type"] == "nack"
        assert isinstance(command["subscription"], str)
        assert command["subscription"]
        assert isinstance(command["topic"], str)
        assert command["topic"]
        for name in ("partition", "offset", "redelivery_count"):
            assert type(command[name]) is int
            assert command[name] >= 0
        timing = {"delay_ms", "deliver_at"} & command.keys()
        assert len(timing) == 1
        (when,) = timing
        assert type(command[when]) is int
        assert command[when] >= 0
        allowed = {"v", "type", "subscription", "topic", "partition", "offset", "redelivery_count", when}
        assert set(command) == allowed


def test_nack_timedelta_and_nack_at_forms() -> None:
    producer = FakeProducer()
    nacker = Nacker(producer, subscription="billing")
    nacker.nack(outbound(), timedelta(minutes=2, microseconds=1500))
    assert sent_command(producer)["delay_ms"] == 120_001
    nacker.nack_at(outbound(), 1_763_719_200_000)
    assert sent_command(producer)["deliver_at"] == 1_763_719_200_000
    assert "delay_ms" not in sent_command(producer)
    nacker.nack_at(outbound(), datetime(2025, 11, 21, 10, 0, tzinfo=UTC))
    assert sent_command(producer)["deliver_at"] == 1_763_719_200_000


def test_nack_zero_delay_is_allowed() -> None:
    producer = FakeProducer()
    Nacker(producer, subscription="billing").nack(outbound(), 0)
    assert sent_command(producer)["delay_ms"] == 0


def test_subscription_argument_overrides_the_default() -> None:
    producer = FakeProducer()
    nacker = Nacker(producer, control_topic="ops.control", subscription="billing")
    nacker.nack(outbound(), 1)
    nacker.nack(outbound(), 1, subscription="fraud")
    assert [sent_command(producer, i)["subscription"] for i in (0, 1)] == ["billing", "fraud"]
    assert {call["topic"] for call in producer.calls} == {"ops.control"}


def test_subscription_is_required_not_guessed_from_the_topic() -> None:
    producer = FakeProducer()
    with pytest.raises(ValueError, match="no subscription"):
        Nacker(producer).nack(outbound(), 1000)
    with pytest.raises(ValueError, match="no subscription"):
        Nacker(producer).nack_at(outbound(), 1000)
    assert producer.calls == []


def test_nack_of_a_record_without_origin_headers() -> None:
    producer = FakeProducer()
    nacker = Nacker(producer, subscription="billing")
    with pytest.raises(ValueError, match="no 'delay-origin' header"):
        nacker.nack(FakeMessage([("deliver-after", b"30s")]), 1000)
    record = outbound()
    assert record._headers is not None
    record._headers = [h for h in record._headers if h[0] != "delay-redelivery-count"]
    with pytest.raises(ValueError, match="'delay-redelivery-count'"):
        nacker.nack(record, 1000)
    assert producer.calls == []


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda n: n.nack(outbound(), -1), ValueError),
        (lambda n: n.nack(outbound(), timedelta(seconds=-1)), ValueError),
        (lambda n: n.nack(outbound(), "30s"), TypeError),
        (lambda n: n.nack(outbound(), 1.5), TypeError),
        (lambda n: n.nack_at(outbound(), -1), ValueError),
        (lambda n: n.nack_at(outbound(), datetime(2026, 1, 1)), ValueError),
    ],
)
def test_nack_rejects_bad_timing(call: Callable[[Nacker], None], error: type[Exception]) -> None:
    producer = FakeProducer()
    with pytest.raises(error):
        call(Nacker(producer, subscription="billing"))
    assert producer.calls == []


@pytest.mark.parametrize("kwargs", [{"control_topic": ""}, {"subscription": ""}])
def test_nacker_rejects_empty_names(kwargs: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="must not be empty"):
        Nacker(FakeProducer(), **kwargs)


def test_commands_for_one_message_share_a_key() -> None:
    """Same key, same control partition, so "the latest command wins" follows the order they were sent."""
    producer = FakeProducer()
    nacker = Nacker(producer)
    nacker.nack(outbound(count=0), 1000, subscription="billing")
    nacker.nack(outbound(count=1), 2000, subscription="fraud")
    nacker.nack(outbound(offset=1235), 1000, subscription="billing")
    keys = [call["key"] for call in producer.calls]
    assert keys[0] == keys[1] != keys[2]


def test_flush_passes_through_and_calls_the_users_callback() -> None:
    producer = FakeProducer()
    reports: list[tuple[object, object]] = []
    nacker = Nacker(producer, subscription="billing")
    nacker.nack(outbound(), 1000, on_delivery=lambda err, msg: reports.append((err, msg)))
    assert nacker.flush(5.0) == 0
    assert reports == [(None, None)]


def test_flush_raises_when_a_command_was_not_written() -> None:
    producer = FakeProducer(error="Local: Message timed out")
    nacker = Nacker(producer, subscription="billing")
    nacker.nack(outbound(), 1000)
    with pytest.raises(NackDeliveryError, match=r"payments\.orders/3/1234 for 'billing': Local: Message timed out"):
        nacker.flush()
    producer.error = None
    nacker.nack(outbound(), 1000)
    assert nacker.flush() == 0  # the failure was reported once, not again


# --- backoff ---------------------------------------------------------------------------------------------


def test_backoff_delay_defaults() -> None:
    assert [backoff_delay(n) for n in range(12)] == [
        1_000,
        2_000,
        4_000,
        8_000,
        16_000,
        32_000,
        64_000,
        128_000,
        256_000,
        512_000,
        600_000,
        600_000,
    ]


def test_backoff_delay_parameters() -> None:
    assert backoff_delay(3, base_ms=500, factor=3.0, max_ms=100_000) == 13_500
    assert backoff_delay(5, base_ms=250, factor=1.0) == 250
    assert backoff_delay(2, base_ms=100, factor=1.5) == 225
    assert backoff_delay(0, base_ms=0) == 0
    assert backoff_delay(10**6) == 600_000  # no OverflowError for a message that never succeeds
    assert backoff_delay(1_100, base_ms=1_000) == 600_000
    assert isinstance(backoff_delay(1, factor=1.5), int)


@pytest.mark.parametrize(
    "kwargs",
    [{"redelivery_count": -1}, {"redelivery_count": 0, "base_ms": -1}, {"redelivery_count": 0, "factor": 0.5}],
)
def test_backoff_delay_rejects(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        backoff_delay(**kwargs)


# --- the README's consumer example ---------------------------------------------------------------------


def load_example() -> ModuleType:
    path = Path(__file__).resolve().parents[1] / "examples" / "retry_with_backoff.py"
    spec = importlib.util.spec_from_file_location("retry_with_backoff", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class FakeConsumer:
    def __init__(self, config: dict[str, Any], records: list[FakeMessage]) -> None:
        assert config["enable.auto.commit"] is False
        self.records = records
        self.committed: list[FakeMessage] = []
        self.closed = False

    def subscribe(self, topics: list[str]) -> None:
        assert topics == ["payments.orders.billing"]

    def poll(self, timeout: float) -> FakeMessage | None:
        if not self.records:
            raise KeyboardInterrupt
        return self.records.pop(0)

    def commit(self, message: FakeMessage, asynchronous: bool) -> None:
        assert asynchronous is False
        self.committed.append(message)

    def close(self) -> None:
        self.closed = True


def test_retry_with_backoff_example(monkeypatch: pytest.MonkeyPatch) -> None:
    example = load_example()
    good = outbound(offset=1)
    failing = [outbound(offset=2, count=n) for n in range(4)]
    for record in failing:
        record._value = b"fail"
    records: list[FakeMessage] = [good, *failing]
    consumers: list[FakeConsumer] = []
    producer = FakeProducer()

    def consumer(config: dict[str, Any]) -> FakeConsumer:
        consumers.append(FakeConsumer(config, records))
        return consumers[-1]

    monkeypatch.setattr(example, "Consumer", consumer)
    monkeypatch.setattr(example, "Producer", lambda config: producer)
    argv = ["x", "--topic", "payments.orders.billing", "--subscription", "billing", "--group-id", "g"]
    monkeypatch.setattr(sys, "argv", [*argv, "--max-retries", "3"])
    example.main()

    assert [sent_command(producer, i)["delay_ms"] for i in range(len(producer.calls))] == [1_000, 2_000, 4_000]
    assert {sent_command(producer, i)["offset"] for i in range(len(producer.calls))} == {2}
    assert consumers[0].committed == [good, *failing]  # the fourth failure is given up on, and committed
    assert consumers[0].closed


def test_outbound_consumers_read_committed_by_default() -> None:
    config = outbound_consumer_config("h:9092", "billing", **{"auto.offset.reset": "earliest"})
    assert config == {"bootstrap.servers": "h:9092", "group.id": "billing", "isolation.level": "read_committed",
                      "auto.offset.reset": "earliest"}  # fmt: skip
    assert outbound_consumer_config("h", "g", **{"isolation.level": "read_uncommitted"})["isolation.level"] == (
        "read_uncommitted"
    )
