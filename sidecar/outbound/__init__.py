"""Outbound: records for subscriptions' outbound topics and for dead-letter topics."""
