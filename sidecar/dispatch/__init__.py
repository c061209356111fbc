"""Dispatch: due index entries become deliveries, with their payloads read ahead of time.

dispatcher.py pops what is due and hands it to delivery; read_ahead.py reads payloads before their
due time into held.py's memory; fetch.py reads payloads from the payload cache (payload_cache.py,
opened by cache_store.py), then back from the log (reader.py). recent.py keeps the records read
last for nacks; roll.py brings payloads for partitions restored from the state topic; removal.py
and drain.py dead-letter the pending records of topics removed from the policies.
"""
