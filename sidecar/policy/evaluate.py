"""What a record's delay becomes under its topic's policy (PIP-437 precedence: fixed > max > none).

Pure code: headers, timestamps and limits in, a decision or a RejectedRecord out. No clock is read:
"now" is the record's publish time, so replaying a record gives the same decision.
"""

from typing import NamedTuple

from sidecar.durations import format_duration_ms
from sidecar.errors import RejectedRecord
from sidecar.policy.headers import Headers, delay_request
from sidecar.policy.model import EffectiveDelay

EXCEEDS_MAX_DELAY = "EXCEEDS_MAX_DELAY"
EXCEEDS_RETENTION = "EXCEEDS_RETENTION"


class Decision(NamedTuple):
    deliver_at: int | None
    """Effective deliver-at in epoch ms, always after the publish time; None delivers at once, and
    the outbound `delay-deliver-at` is then the publish time. A deliver-at at or before the publish
    time (`0`, `1000`, an hour ago) asks for "at once" and gets None: one rule for every past value."""
    overridden: bool = False
    """A fixed delay replaced a header the producer sent (messages_fixed_delay_overridden_total)."""
    disabled: bool = False
    """Delays are disabled for the topic and the record asked for one; it goes out at once (counted)."""
    miscased: bool = False
    """The record has a header like `Deliver-At`: not a delay header, since names are case-sensitive.
    The caller counts it (delay_header_miscased_total) so the producer can be found."""


def decide(delay: EffectiveDelay, headers: Headers, publish_ms: int, retention_ms: int | None = None) -> Decision:
    """The effective deliver-at of one record, or RejectedRecord (code + message) for its dead-letter topic.

    Order, as in PIP-437 and contract section 2:
    1. The delay header is parsed first, on every topic. An invalid header is rejected with
       INVALID_DELAY_HEADER even where a fixed delay or `enabled: false` would have made its value
       irrelevant: contract section 1 rejects invalid headers without exception, and the producer
       that sent it is broken and should hear about it before the topic's policy changes and its
       header starts to matter.
    2. `enabled: false`: delivered at once; `disabled` tells the caller to count it when a header asked.
    3. fixed > 0: publish time + fixed, whatever the header asked; the max policy is not applied.
    4. max > 0: a requested delay (deliver-at minus publish time) longer than max is rejected with
       EXCEEDS_MAX_DELAY; the message says the limit, where it came from and by how much it was exceeded.
    5. A deliver-at later than the inbound topic keeps records (`retention_ms`; None or negative means
       forever, as Kafka's retention.ms=-1) is rejected with EXCEEDS_RETENTION: the record would be
       deleted from the inbound topic before it is due.

    Exclusive/failover subscriptions ignore delays (SubscriptionRoute.ordered); that is routing,
    done by the caller after this decision, not here.
    """
    request = delay_request(headers, publish_ms)
    decision = _decide(delay, request.deliver_at, publish_ms, retention_ms)
    return decision._replace(miscased=True) if request.miscased is not None else decision


def _decide(delay: EffectiveDelay, requested: int | None, publish_ms: int, retention_ms: int | None) -> Decision:
    if not delay.is_enabled:
        return Decision(None, disabled=requested is not None)
    if delay.fixed_ms > 0:
        deliver_at = publish_ms + delay.fixed_ms
        decision = Decision(deliver_at, overridden=requested is not None)
    elif requested is None or requested <= publish_ms:
        return Decision(None)
    else:
        deliver_at = requested
        over = deliver_at - publish_ms - delay.max_ms
        if delay.max_ms > 0 and over > 0:
            raise RejectedRecord(
                EXCEEDS_MAX_DELAY,
                f"delay of {format_duration_ms(deliver_at - publish_ms)} exceeds the max delivery delay "
                f"{format_duration_ms(delay.max_ms)} (from {delay.max_delivery_delay.source}) "
                f"by {format_duration_ms(over)}",
            )
        decision = Decision(deliver_at)
    if retention_ms is not None and retention_ms >= 0 and deliver_at - publish_ms > retention_ms:
        raise RejectedRecord(
            EXCEEDS_RETENTION,
            f"deliver-at is {format_duration_ms(deliver_at - publish_ms)} after publish, but the inbound "
            f"topic keeps records for retention.ms={retention_ms} ({format_duration_ms(retention_ms)}); "
            "the record would be deleted before delivery",
        )
    return decision
