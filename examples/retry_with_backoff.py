"""Reconsume later, without a retry topic: nack a failed record and let the delay sidecar redeliver it.

Read a subscription's outbound topic; when processing fails, ask the sidecar to deliver the same
message again after an exponential backoff (1s, 2s, 4s, ...). After --max-retries redeliveries, give
up: log it and move on. Every record's offset is committed once it is done with, either processed or
nacked (the sidecar now owns the retry) or given up on.

    python examples/retry_with_backoff.py --bootstrap-servers localhost:9092 \
        --topic payments.orders.billing --subscription billing --group-id billing --max-retries 5
"""

import argparse
import logging

from confluent_kafka import Consumer, Message, Producer

from sidecar.client import Nacker, backoff_delay, origin, redelivery_count

log = logging.getLogger("retry_with_backoff")


def process(record: Message) -> None:
    """Your business logic: raise to have the record retried later."""
    if b"fail" in (record.value() or b""):
        raise RuntimeError("downstream service unavailable")
    log.info("processed %s", origin(record))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap-servers", default="localhost:9092")
    parser.add_argument("--topic", required=True, help="the subscription's outbound topic")
    parser.add_argument("--subscription", required=True, help="the subscription the nacks are for")
    parser.add_argument("--group-id", required=True)
    parser.add_argument("--max-retries", type=int, default=5)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    consumer = Consumer(
        {
            "bootstrap.servers": args.bootstrap_servers,
            "group.id": args.group_id,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
        }
    )
    producer = Producer({"bootstrap.servers": args.bootstrap_servers, "enable.idempotence": True})
    nacker = Nacker(producer, subscription=args.subscription)
    consumer.subscribe([args.topic])
    try:
        while True:
            record = consumer.poll(1.0)
            if record is None:
                continue
            if record.error():
                log.warning("consumer error: %s", record.error())
                continue
            try:
                process(record)
            except Exception as error:
                attempts = redelivery_count(record)
                if attempts < args.max_retries:
                    delay_ms = backoff_delay(attempts)
                    nacker.nack(record, delay_ms)
                    nacker.flush()  # raises if the nack was not written: then do not commit
                    log.info("%s failed (%s); retry %d in %d ms", origin(record), error, attempts + 1, delay_ms)
                else:
                    log.error("%s failed %d times, giving up: %s", origin(record), attempts + 1, error)
            consumer.commit(message=record, asynchronous=False)
    except KeyboardInterrupt:
        pass
    finally:
        consumer.close()


if __name__ == "__main__":
    main()
