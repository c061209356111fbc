"""Dispatch: reading due records back from the inbound log, in offset ranges."""
