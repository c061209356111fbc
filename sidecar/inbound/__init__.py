"""Inbound: reading producers' records and deciding what each one asks for."""
