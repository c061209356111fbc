"""The at-least-once commit rides out a moving group coordinator, and fails at once on anything else.

An engine restart sends again everything since the last commit: at least once that is allowed, but a
coordinator that moves for a moment (NOT_COORDINATOR from a loaded broker) is no reason for it. The
Java consumer's commitSync asks again too. A periodic commit is sent asynchronously and answered
through `on_commit`, as librdkafka answers it at a later poll. No broker: the consumer is a stand-in
that answers what the test tells it to.
"""

import time
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition
from prometheus_client import CollectorRegistry

from sidecar import checkpoint
from sidecar.checkpoint import Checkpoints
from sidecar.clock import ManualClock
from sidecar.errors import BrokerError
from sidecar.metrics import BucketMetrics, Metrics
from sidecar.partitions.state import PartitionState
from sidecar.tracker.memory import InMemoryTracker
from tests.fake_clock import MonotonicClock


class _Consumer:
    def __init__(self, answers: list[int]) -> None:
        self.answers = answers
        """Error codes the next commits fail with, in order; then commits succeed."""
        self.commits: list[list[TopicPartition]] = []
        self.member = "vm-1-5f2c"
        """The member id librdkafka holds: "" once it timed its group session out."""

    @property
    def consumer(self) -> "_Consumer":
        """The group member's consumer of the moment (inbound/member.py): this one."""
        return self

    def memberid(self) -> str:
        return self.member

    def commit(self, offsets: list[TopicPartition], asynchronous: bool) -> None:
        self.commits.append(offsets)
        if self.answers and not asynchronous:
            raise KafkaException(KafkaError(self.answers.pop(0)))


class _Writer:
    transactional = False
    transactional_id = None

    def __init__(self, acknowledges: bool = True, without_id_s: float = 0.0) -> None:
        self.acknowledges = acknowledges
        self.without_id = without_id_s
        self.id_state = "Assigned" if without_id_s == 0 else "WaitTransport"
        self.producer: list[bytes] = [b"queued"] if not acknowledges else []

    def flush(self) -> None:
        pass

    def acknowledged(self, timeout_s: float) -> bool:
        return self.acknowledges

    def without_id_s(self) -> float:
        return self.without_id

    def describe(self) -> str:
        return f"id_state={self.id_state}"


def _checkpoints(consumer: _Consumer, landed: list[int] | None = None) -> Checkpoints:
    metrics = BucketMetrics(Metrics(CollectorRegistry()))
    told = landed if landed is not None else []
    return Checkpoints(_Writer(), consumer, None, None, metrics, landed=lambda: told.append(1))  # type: ignore[arg-type]


def _answer(checkpoints: Checkpoints, consumer: _Consumer, code: int | None = None) -> None:
    """librdkafka's answer to the last commit sent, as `on_commit` gets it at a poll."""
    checkpoints.on_commit(KafkaError(code) if code is not None else None, consumer.commits[-1])


def _state() -> PartitionState:
    return PartitionState("orders", 0, InMemoryTracker(ManualClock(0)))


@pytest.fixture(autouse=True)
def _no_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checkpoint.time, "sleep", lambda _: None)


@pytest.mark.parametrize(
    "code",
    [KafkaError.NOT_COORDINATOR, KafkaError.COORDINATOR_NOT_AVAILABLE, KafkaError.COORDINATOR_LOAD_IN_PROGRESS],
)
def test_a_commit_is_asked_again_while_the_coordinator_moves(code: int) -> None:
    consumer = _Consumer([code, code])
    state = _state()
    point = (42, '{"earliest":7}')
    checkpoints = _checkpoints(consumer)
    checkpoints._whole = True  # a revoke's or a stop's: made on the calling thread
    assert checkpoints._commit([(state, point, "fp")]) == 1
    assert len(consumer.commits) == 3
    assert [(tp.offset, tp.metadata) for tp in consumer.commits[-1]] == [point]
    assert state.committed == point and state.committed_fingerprint == "fp"


def test_a_commit_that_fails_otherwise_fails_at_once_and_changes_nothing() -> None:
    consumer = _Consumer([KafkaError.ILLEGAL_GENERATION])
    state = _state()
    checkpoints = _checkpoints(consumer)
    checkpoints._whole = True
    with pytest.raises(BrokerError, match="a restart resumes at the last commit"):
        checkpoints._commit([(state, (42, "{}"), "fp")])
    assert len(consumer.commits) == 1
    assert state.committed is None


def test_a_periodic_commit_refused_otherwise_is_raised_by_the_engine_and_changes_nothing() -> None:
    consumer = _Consumer([])
    checkpoints, state = _checkpoints(consumer), _state()
    assert checkpoints._commit([(state, (42, "{}"), "fp")]) == 0
    _answer(checkpoints, consumer, KafkaError.OFFSET_METADATA_TOO_LARGE)
    assert checkpoints.error is not None and "a restart resumes at the last commit" in str(checkpoints.error)
    assert state.committed is None


@pytest.mark.parametrize(
    "code", [KafkaError.ILLEGAL_GENERATION, KafkaError.UNKNOWN_MEMBER_ID, KafkaError.REBALANCE_IN_PROGRESS]
)
def test_a_periodic_commit_refused_because_the_group_moved_on_starts_nothing_again(code: int) -> None:
    """CI on noida-db (a broker restarted twice in 4 s): the member's partitions were lost while a
    periodic commit was out, its answer was ILLEGAL_GENERATION, and the engine started again from
    the last commit: 544 of 6,000 records went out twice at least once. The rebalance decides where
    the partitions go; whoever owns them next starts from the last commit."""
    consumer = _Consumer([])
    checkpoints, state = _checkpoints(consumer), _state()
    assert checkpoints._commit([(state, (42, "{}"), "fp")]) == 0
    _answer(checkpoints, consumer, code)
    assert checkpoints.error is None and not checkpoints.fenced_after_lapse
    assert state.committed is None


def test_a_coordinator_that_stays_away_puts_the_commit_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Failing the engine sent again everything acknowledged since the last commit (issue 48); the
    next checkpoint commits as much and more."""
    now = [0.0]

    def monotonic() -> float:
        now[0] += 1.0
        return now[0]

    monkeypatch.setattr(checkpoint.time, "monotonic", monotonic)
    consumer: Any = _Consumer([KafkaError.NOT_COORDINATOR] * 1000)
    checkpoints, state = _checkpoints(consumer), _state()
    checkpoints._whole = True
    assert checkpoints._commit([(state, (42, "{}"), "fp")]) == 0
    assert 1 < len(consumer.commits) < 1000
    assert checkpoints.put_off and state.committed is None


def test_no_periodic_commit_is_asked_for_while_the_brokers_are_away() -> None:
    """librdkafka's synchronous commit, asked for while no coordinator is known, waits for one: it
    held the loop until the session timed out, then failed, and the engine started again."""
    consumer, reachable = _Consumer([]), [False]
    metrics = BucketMetrics(Metrics(CollectorRegistry()))
    checkpoints = Checkpoints(_Writer(), consumer, None, None, metrics, lambda: reachable[0])  # type: ignore[arg-type]
    state = _state()
    state.next_offset = 5
    assert checkpoints.run([state], whole=False) == 0
    assert checkpoints.put_off and consumer.commits == []
    reachable[0] = True
    assert checkpoints.run([state], whole=False) == 0  # sent: answered at a later poll
    assert not checkpoints.put_off and [tp.offset for tp in consumer.commits[-1]] == [5]


@pytest.mark.parametrize("whole", [True, False])
def test_a_partition_with_requests_set_aside_is_not_committed_past_them(whole: bool) -> None:
    """Set aside while the partition is held, a request is decided when the hold ends: a commit
    before then, past it, followed by a crash or a fence, and no member would read it again."""
    consumer = _Consumer([])
    checkpoints, state = _checkpoints(consumer), _state()
    state.next_offset = 5
    state.held_requests = [(3, b"a cancel")]
    checkpoints.run([state], whole=whole)
    assert consumer.commits == [] and state.committed is None
    state.held_requests = []
    checkpoints.run([state], whole=whole)
    assert [tp.offset for tp in consumer.commits[-1]] == [5]


def test_a_commit_waiting_for_the_fsync_is_not_made_while_the_brokers_are_away() -> None:
    """The periodic commit waits for the index's fsync and is made on a later turn (`settle`): the
    brokers can go in between."""
    consumer, reachable = _Consumer([]), [True]
    metrics = BucketMetrics(Metrics(CollectorRegistry()))
    checkpoints = Checkpoints(_Writer(), consumer, None, lambda: None, metrics, lambda: reachable[0])  # type: ignore[arg-type]
    state = _state()
    state.next_offset = 5
    assert checkpoints.run([state], whole=False) == 0  # the fsync runs beside the loop
    while checkpoints.syncing:
        time.sleep(0.01)
    reachable[0] = False
    assert checkpoints.settle([state]) == 0 and consumer.commits == []
    reachable[0] = True
    assert checkpoints.settle([state]) == 0 and [tp.offset for tp in consumer.commits[-1]] == [5]
    _answer(checkpoints, consumer)
    assert state.committed is not None and state.committed[0] == 5
    checkpoints.close()


def test_no_commit_is_sent_once_the_client_timed_its_session_out() -> None:
    """librdkafka resets a member's id when no heartbeat was answered for session.timeout.ms, and
    hands the lost partitions over at the next poll. A static member's commit sent in between,
    with no member id, is refused FENCED_INSTANCE_ID and the consumer goes fatal (CI: two broker
    restarts close together; the engine started again and repeated a record)."""
    consumer = _Consumer([])
    consumer.member = ""
    checkpoints = _checkpoints(consumer)
    state = _state()
    assert checkpoints._commit([(state, (42, "{}"), "fp")]) == 0
    assert consumer.commits == [] and checkpoints.put_off
    assert state.committed is None
    consumer.member = "vm-1-9a01"  # the group has it again: the next checkpoint commits
    checkpoints._commit([(state, (42, "{}"), "fp")])
    _answer(checkpoints, consumer)
    assert state.committed == (42, "{}")


def test_a_periodic_commit_is_noted_once_answered_and_none_is_sent_meanwhile() -> None:
    """Sent asynchronously: a synchronous commit waiting on another thread for a coordinator that
    stopped answering held the loop's consume as long as it waited (the loop stopped, and no lost
    partition was handled; CI: a broker outage and nothing logged for 120 s)."""
    consumer, landed = _Consumer([]), []
    checkpoints, state = _checkpoints(consumer, landed), _state()
    assert checkpoints._commit([(state, (42, "{}"), "fp")]) == 0
    assert state.committed is None and landed == []
    assert checkpoints._commit([(state, (43, "{}"), "fp2")]) == 0
    assert len(consumer.commits) == 1 and checkpoints.put_off  # one at a time
    _answer(checkpoints, consumer)
    assert state.committed == (42, "{}") and state.committed_fingerprint == "fp" and landed == [1]
    checkpoints._commit([(state, (43, "{}"), "fp2")])
    assert len(consumer.commits) == 2


@pytest.mark.parametrize("code", [KafkaError.NOT_COORDINATOR, KafkaError._TRANSPORT, KafkaError._WAIT_COORD])
def test_a_periodic_commit_the_coordinator_did_not_take_is_sent_again_by_the_next(code: int) -> None:
    consumer = _Consumer([])
    checkpoints, state = _checkpoints(consumer), _state()
    checkpoints._commit([(state, (42, "{}"), "fp")])
    _answer(checkpoints, consumer, code)
    assert checkpoints.error is None and state.committed is None
    checkpoints._commit([(state, (42, "{}"), "fp")])
    assert len(consumer.commits) == 2


def test_an_answer_older_than_a_whole_commit_since_changes_nothing() -> None:
    """A revoke's commit, made while a periodic one was unanswered, is newer than it."""
    consumer = _Consumer([])
    checkpoints, state = _checkpoints(consumer), _state()
    checkpoints._commit([(state, (42, "{}"), "fp")])
    periodic = consumer.commits[-1]
    checkpoints._whole = True
    checkpoints._commit([(state, (50, "{}"), "fp3")])
    checkpoints._whole = False
    checkpoints.on_commit(None, periodic)
    assert state.committed == (50, "{}") and state.committed_fingerprint == "fp3"


def test_a_fence_of_a_commit_sent_after_the_session_lapsed_is_told_from_another_members() -> None:
    """librdkafka holds a commit while no coordinator answers and sends it once one does, under
    the member id it has then: none after its session timed out, and a static member's commit with
    no member id is refused FENCED_INSTANCE_ID. A fence under the same member id is another
    process's, with this instance id."""
    consumer = _Consumer([])
    checkpoints, state = _checkpoints(consumer), _state()
    checkpoints._commit([(state, (42, "{}"), "fp")])
    _answer(checkpoints, consumer, KafkaError.FENCED_INSTANCE_ID)
    assert not checkpoints.fenced_after_lapse and checkpoints.error is not None
    checkpoints = _checkpoints(consumer)
    checkpoints._commit([(state, (42, "{}"), "fp")])
    consumer.member = ""
    _answer(checkpoints, consumer, KafkaError.FENCED_INSTANCE_ID)
    assert checkpoints.fenced_after_lapse and checkpoints.error is None and state.committed is None


def test_a_writer_without_a_producer_id_while_the_brokers_answer_is_replaced() -> None:
    """CI: librdkafka left the idempotent producer without an id after a broker restart, and not one
    record was acknowledged until message.timeout.ms (5 minutes) failed them all. Now the engine
    starts again with a new producer once it has been without one for WITHOUT_ID_S."""
    clock, reachable = MonotonicClock(1000.0), [True]
    writer = _Writer(acknowledges=False, without_id_s=0.0)
    metrics = BucketMetrics(Metrics(CollectorRegistry()))
    checkpoints = Checkpoints(writer, _Consumer([]), None, None, metrics, lambda: reachable[0], clock=clock)  # type: ignore[arg-type]
    state = _state()
    state.next_offset = 5
    clock.now += 100
    assert checkpoints.run([state], whole=False) == 0 and checkpoints.put_off  # it has an id: the brokers are slow
    reachable[0] = False
    clock.now += 100
    writer.without_id = 200.0
    checkpoints.run([state], whole=False)  # the brokers away: nobody gets an id
    reachable[0] = True
    clock.now += checkpoint.WITHOUT_ID_S - 1
    checkpoints.run([state], whole=False)  # back for less than WITHOUT_ID_S: it may get one yet
    assert checkpoints.put_off
    clock.now += 1
    with pytest.raises(BrokerError, match="no producer id for 30 s while the brokers answer"):
        checkpoints.run([state], whole=False)
    writer.without_id = checkpoint.WITHOUT_ID_S - 1  # lost it again, a moment ago
    checkpoints.run([state], whole=False)
    assert checkpoints.put_off
