"""The group assigns what this member subscribes to, from its first second.

A static member that comes back within the session timeout is handed the group's stored
assignment. Apache Kafka (4.1, classic protocol) rebalances on such a return only when the
protocol's name changes, not its topics (KAFKA-12759, open), and librdkafka never compares its
subscription with its assignment. A topic added to the policies across a restart was then assigned
to no member (0 of 400 records served in a minute), and a removed topic stayed with this one.

So after each start, once the group is stable, the member checks: each subscribed topic that
exists has its partitions assigned to some member, and this member holds no topic it does not
subscribe to. If not, it makes the group assign again: it subscribes for a moment to a list
without the topics in question, which sends the coordinator new member metadata (it rebalances
on that, leader or follower), and after that assignment to its own list again. A live policy
change needs none of this: its new subscription is new metadata already.
"""

import logging
import time
from collections.abc import Callable, Mapping, Set

logger = logging.getLogger(__name__)

# How often the group's assignment is looked at until it is found right, and for how long.
LOOK_EVERY_S = 2.0
LOOK_FOR_S = 120.0
# Rebalances this member asks for after one start, at most: with several members coming back at
# once, each may ask; more than this means something else is wrong, and the log says so.
MAX_ASKS = 3


def wrong_topics(
    subscribed: Set[str], partitions: Mapping[str, int], group_assigned: Set[str], own_assigned: Set[str]
) -> frozenset[str]:
    """Topics the group's assignment has wrong for this member: subscribed to and existing but
    assigned to no member, or assigned to this member without being subscribed to."""
    missing = {t for t in subscribed if partitions.get(t, 0) > 0 and t not in group_assigned}
    return frozenset(missing | (own_assigned - subscribed))


GroupView = tuple[bool, frozenset[str]]
"""(the group is stable, the topics of every member's assignment)."""


class Coverage:
    """Watches the first assignments after a start, and asks for a rebalance when they are wrong."""

    def __init__(
        self,
        describe: Callable[[], GroupView | None],
        own: Callable[[], frozenset[str]],
        partitions: Callable[[], Mapping[str, int]],
        subscribe: Callable[[list[str]], None],
        assignments: Callable[[], int],
    ) -> None:
        """`describe`: the group as the coordinator describes it (None when it cannot say); `own`: the
        topics this member is assigned; `subscribe`: the consumer's; `assignments`: how many
        assignments this member has been given so far."""
        self._describe = describe
        self._own = own
        self._partitions = partitions
        self._subscribe = subscribe
        self._assignments = assignments
        self._topics: frozenset[str] = frozenset()
        self._until = 0.0
        self._next = 0.0
        self._asks = 0
        self._back_after: int | None = None
        """Set while subscribed to the other list: the assignment count after which to subscribe back."""

    def watch(self, topics: frozenset[str]) -> None:
        """The consumer subscribed to `topics` at a start: look at the assignment until it is right."""
        self._topics = topics
        self._until = time.monotonic() + LOOK_FOR_S
        self._next = 0.0
        self._asks = 0

    def turn(self) -> None:
        """From the loop, between polls (never in a rebalance callback): cheap unless a look is due."""
        if not self._topics:
            return
        now = time.monotonic()
        if self._back_after is not None:
            if self._assignments() > self._back_after or now > self._until:
                self._back_after = None
                self._subscribe(sorted(self._topics))
                self._next = now + LOOK_EVERY_S
            return
        if now < self._next:
            return
        if now > self._until:
            logger.warning("the group's assignment was not seen right after the start; giving up looking")
            self._topics = frozenset()
            return
        self._next = now + LOOK_EVERY_S
        if self._assignments() == 0:
            return  # not assigned yet: nothing to compare
        view = self._describe()
        if view is None or not view[0]:
            return  # a rebalance is under way: look again once it is done
        wrong = wrong_topics(self._topics, self._partitions(), view[1], self._own())
        if not wrong:
            self._topics = frozenset()  # right: nothing more to watch until the next start
            return
        if self._asks >= MAX_ASKS:
            logger.error(
                "the group still assigns topics against this member's subscription after %d rebalances "
                "topics=%s; restart the members whose policies differ",
                self._asks,
                ",".join(sorted(wrong)),
            )
            self._topics = frozenset()
            return
        other = sorted(self._topics - wrong)
        if len(other) == len(self._topics):  # only topics it holds and does not subscribe to: any change will do
            other = other[1:]
        if not other:
            logger.error("cannot make the group assign again: this member subscribes to one topic only")
            self._topics = frozenset()
            return
        self._asks += 1
        logger.warning(
            "the group's assignment does not match this member's subscription (a static member back with "
            "another policy); asking for a rebalance topics=%s",
            ",".join(sorted(wrong)),
        )
        self._back_after = self._assignments()
        self._subscribe(other)
