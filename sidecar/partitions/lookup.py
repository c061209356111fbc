"""Where is message topic/partition/offset? The answer from the member that owns its partition.

Asked by an operator (GET /messages/{topic}/{partition}/{offset}, `delay-sidecar messages show`),
answered on the engine's own thread between two loop turns, so it reads the index as the loop
leaves it. The index holds positions, not times: for a deliver-at the record is read back and
judged again with the rule it was taken in with, as a rebuild would.
"""

from collections.abc import Callable, Mapping
from concurrent.futures import Future
from queue import SimpleQueue
from typing import Any, NamedTuple

from confluent_kafka import Message

from sidecar.control.cancels import is_marked, key_fields
from sidecar.partitions import TopicPartitionKey
from sidecar.partitions.state import PartitionState
from sidecar.policy.intake import judge
from sidecar.policy.routes import Routes
from sidecar.tracker.base import pack

ReadOne = Callable[[str, int, int], Message | None]
Asked = int | bytes
"""A message by its offset, or, on a keyed topic, by its key: the key's newest record in the partition."""
Nacks = Mapping[str, tuple[int, int]]
"""A message's nacks pending at one member, by subscription: (deliver-at, redelivery count it will carry)."""


class Whereabouts(NamedTuple):
    """What one member knows of a message."""

    answer: dict[str, Any] | None
    """The owner's answer (`locate`); None at a member that does not own the message's partition."""
    nacks: Nacks
    """Its nacks pending here: this member owns the control partitions they came on."""
    member_id: str
    """This member's id in the consumer group, to tell itself apart from the others."""


class Questions:
    """Questions asked from the HTTP thread, answered on the engine's thread between two turns:
    the index and the nack table are the loop's own, and are read only from it."""

    def __init__(
        self,
        states: Mapping[TopicPartitionKey, PartitionState],
        routes: Callable[[], Mapping[str, Routes]],
        retention_ms: Mapping[str, int | None],
        read: ReadOne,
        nacks: Callable[[str, int, int, list[str]], Nacks],
        member_id: Callable[[], str],
    ) -> None:
        """`nacks`: (topic, partition, offset, subscriptions) to the message's nacks pending here."""
        self._states = states
        self._routes = routes
        self._retention_ms = retention_ms
        self._read = read
        self._nacks = nacks
        self._member_id = member_id
        self._asked: SimpleQueue[tuple[str, int, Asked, Future[Whereabouts]]] = SimpleQueue()

    def ask(self, topic: str, partition: int, asked: Asked, timeout_s: float) -> Whereabouts:
        """From any thread: waits for the loop's answer (TimeoutError when it is stuck)."""
        question: Future[Whereabouts] = Future()
        self._asked.put((topic, partition, asked, question))
        return question.result(timeout_s)

    def answer(self) -> None:
        """On the engine's thread: every question asked since the last turn."""
        while not self._asked.empty():
            topic, partition, offset, question = self._asked.get_nowait()
            try:
                question.set_result(self._where(topic, partition, offset))
            except Exception as e:  # the asker gets the error; the loop goes on
                question.set_exception(e)

    def _where(self, topic: str, partition: int, asked: Asked) -> Whereabouts:
        state = self._states.get((topic, partition))
        routes = self._routes().get(topic)
        owner = state is not None and not state.control and routes is not None
        offset, key = (asked, None) if isinstance(asked, int) else (None, asked)
        if key is not None:
            newest = state.keyed.newest(key) if state is not None and state.keyed is not None else None
            if newest is None:
                about = {"topic": topic, "partition": partition, **key_fields(key), "state": "unknown"}
                reason = "no record of this key read from the partition (a topic without by_key: replace, or not yet)"
                return Whereabouts({**about, "reason": reason} if owner else None, {}, self._member_id())
            offset = newest[0]
        assert offset is not None
        # A nack lies with its control partition's owner, which need not own the message.
        subs = [s.name for s in routes.route.subscriptions] if routes is not None else []
        nacks = self._nacks(topic, partition, offset, subs)
        answer = None
        if owner:
            assert state is not None and routes is not None
            answer = locate(state, routes, self._retention_ms.get(topic), offset, self._read, nacks)
            if key is not None:
                answer = {**answer, **key_fields(key)}
        return Whereabouts(answer, nacks, self._member_id())


def locate(
    state: PartitionState,
    routes: Routes,
    retention_ms: int | None,
    offset: int,
    read: ReadOne,
    nacks: Nacks | None = None,
) -> dict[str, Any]:
    """The message's fate per subscription: pending, delivered, cancelled, replaced (a keyed topic's
    record that a newer one of its key replaced), tombstone (a keyed topic's, delivered to none of
    the subscriptions that honour delays) or dead-lettered.

    `nacks`: the message's nacks pending at this member (`with_nacks`)."""
    answer: dict[str, Any] = {"topic": state.topic, "partition": state.partition, "offset": offset}
    if state.next_offset is None or offset >= state.next_offset:
        return {**answer, "state": "unknown", "reason": "not read from the partition yet"}
    if state.rebuild is not None or state.holding:
        return {**answer, "state": "unknown", "reason": "the partition's index is being rebuilt; ask again shortly"}
    message = read(state.topic, state.partition, offset)
    if message is None:
        return {**answer, "state": "unknown", "reason": "no such record in the log (retention, or past its end)"}
    headers = message.headers()
    if is_marked(headers):
        return {**answer, "state": "unknown", "reason": "a cancel or reschedule record of the sidecar, not a message"}
    publish_ms = max(message.timestamp()[1], 0)
    rule = state.rules.at(offset) or routes.rule(retention_ms)
    fate = judge(rule, headers, publish_ms)
    if fate.rejected is not None:
        return {**answer, "state": "dead-lettered", "code": fate.rejected.code, "message": fate.rejected.message}
    subscriptions: dict[str, dict[str, Any]] = {}
    for name, _ in routes.ordered:
        subscriptions[name] = {"state": "delivered", "deliver_at": publish_ms}
    keyed = state.keyed
    if keyed is not None and rule.keyed and message.key() and message.value() is None:
        subscriptions.update({name: {"state": "tombstone"} for name in rule.delayed})
    elif keyed is not None and fate.deliver_at is not None and keyed.was_replaced(offset):
        newest = keyed.newest(message.key() or b"")
        replaced = {"state": "replaced", **({"newest_offset": newest[0]} if newest is not None else {})}
        subscriptions.update({name: dict(replaced) for name in rule.delayed})
    elif fate.deliver_at is None:
        for name in rule.delayed:
            subscriptions[name] = {"state": "delivered", "deliver_at": publish_ms}
    else:
        subscriptions.update(_delayed(state, rule.delayed, offset, fate.deliver_at))
    return with_nacks({**answer, "state": "", "publish_ms": publish_ms, "subscriptions": subscriptions}, nacks or {})


def with_nacks(answer: dict[str, Any], nacks: Nacks) -> dict[str, Any]:
    """The owner's answer with a member's pending nacks: the subscription waits for that redelivery,
    whatever its first delivery did. Sets the overall state from the subscriptions'."""
    subscriptions = answer.get("subscriptions")
    if subscriptions is None:  # unknown or dead-lettered: nothing to wait for
        return answer
    for name, (at, count) in nacks.items():
        if name in subscriptions:
            subscriptions[name] = {"state": "pending", "deliver_at": at, "nack": True, "redelivery_count": count}
    states = {s["state"] for s in subscriptions.values()}
    answer["state"] = states.pop() if len(states) == 1 else "mixed"
    return answer


def _delayed(state: PartitionState, owed: tuple[str, ...], offset: int, deliver_at: int) -> dict[str, dict[str, Any]]:
    overrides, tracker = state.overrides, state.tracker
    indexed = tracker.contains(offset)
    held = overrides.suppressed.get(offset, ())
    found: dict[str, dict[str, Any]] = {}
    for name in owed:
        copy = overrides.copy_for(offset, name)
        if copy is not None:
            copy_offset, at, pending = copy
            cancelled = name in overrides.suppressed.get(copy_offset, ())
            if cancelled:
                found[name] = {"state": "cancelled"}
            else:
                found[name] = {"state": "pending" if pending else "delivered", "deliver_at": at, "rescheduled": True}
        elif (name in held and indexed) or name in overrides.recently_cancelled(offset):
            found[name] = {"state": "cancelled"}
        elif indexed or pack(deliver_at, offset) > tracker.delivered_through():
            found[name] = {"state": "pending", "deliver_at": deliver_at}  # (or in no index yet: being rebuilt)
        else:
            found[name] = {"state": "delivered", "deliver_at": deliver_at}
    return found
