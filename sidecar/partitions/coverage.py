"""The group assigns what this member subscribes to, from its first second.

A static member that comes back within the session timeout is handed the group's stored
assignment. Apache Kafka (4.1, classic protocol) rebalances on such a return only when the
protocol's name changes, not its topics (KAFKA-12759, open), and librdkafka never compares its
subscription with its assignment. A topic added to the policies across a restart was then assigned
to no member (0 of 400 records served in a minute), and a removed topic stayed with this one.

So the member remembers, in its state dir, the topics it subscribed to last. When it starts with
other topics, it makes the group assign again once its first assignment has come: it subscribes for
a moment to a list without one of its topics, which sends the coordinator new member metadata (it
rebalances on that, leader or follower), and after that assignment to its own list again. A live
policy change needs none of this: its new subscription is new member metadata already.

A state dir that remembers nothing (a new one, or one that was lost) forces nothing: a first start
needs no rebalance, and forcing one at every start of a new state dir made a lost state dir, a
handoff and a restart under load each pay for two rebalances. A member whose state dir was lost and
whose policies changed while it was down is the case this does not cover: its stored assignment
holds until the group rebalances for another reason.

Asking the coordinator instead (describe_consumer_groups) would also see a topic assigned to no
member, but a describe that timed out during a broker outage aborted the process inside librdkafka
2.16 (`rd_kafka_enq_once_del_source_return: Assertion eonce->refcnt > 0`).
"""

import json
import logging
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

FILE = "subscription.json"


class Coverage:
    """Forces one rebalance after a start whose subscription the group may not know yet."""

    def __init__(
        self, state_dir: Path | None, subscribe: Callable[[list[str]], None], assignments: Callable[[], int]
    ) -> None:
        """`state_dir`: where the last subscription is remembered (None: nowhere, and no rebalance is
        forced); `subscribe`: the consumer's; `assignments`: how many assignments this member has
        been given so far."""
        self._file = state_dir / FILE if state_dir is not None else None
        self._subscribe = subscribe
        self._assignments = assignments
        self._topics: list[str] = []
        self._step: tuple[int, list[str] | None] | None = None
        """(the assignment count to wait past, the list to subscribe to then; None: its own topics)."""

    def subscribed(self, topics: list[str], first: bool) -> None:
        """The consumer subscribed to `topics`; at a start (`first`), when they are not the topics
        remembered, one rebalance is forced once the first assignment has come (`turn`)."""
        self._topics = topics
        if self._file is None:
            return
        remembered = self._remembered() if first else None
        if remembered is not None and remembered != topics:
            other = topics[1:]  # any other list is new member metadata
            if other:
                logger.info(
                    "subscription differs from the last one this state dir remembers; the group will be asked "
                    "to assign again after the first assignment topics=%s",
                    ",".join(topics),
                )
                self._step = (0, other)
        self._remember(topics)

    def turn(self) -> None:
        """From the loop, between polls (never in a rebalance callback)."""
        step = self._step
        if step is None or self._assignments() <= step[0]:
            return
        topics = step[1] or self._topics
        self._subscribe(topics)
        if step[1] is None:
            self._step = None
            logger.info("subscribed again to make the group assign by this member's topics")
        else:
            self._step = (self._assignments(), None)  # then back to its own topics

    def _remembered(self) -> list[str] | None:
        assert self._file is not None
        try:
            topics = json.loads(self._file.read_text())
        except (OSError, ValueError):
            return None
        return topics if isinstance(topics, list) else None

    def _remember(self, topics: list[str]) -> None:
        assert self._file is not None
        try:
            self._file.parent.mkdir(parents=True, exist_ok=True)
            partial = self._file.with_suffix(".tmp")
            partial.write_text(json.dumps(topics))
            partial.replace(self._file)
        except OSError as e:  # the next start forces a rebalance it may not need: no harm
            logger.warning("cannot remember the subscription path=%s error=%s", self._file, e)
