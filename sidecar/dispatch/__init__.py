"""Dispatch: due index entries become deliveries, with their payloads read ahead of time.

dispatcher.py pops what is due and hands it to delivery; read_ahead.py reads payloads before their
due time into held.py's memory; fetch.py reads payloads from the payload cache (payload_cache.py),
then back from the log (reader.py). roll.py and trail.py bring payloads for restored partitions and
monotone runs; drain.py and removal.py handle topics removed with records pending.
"""
