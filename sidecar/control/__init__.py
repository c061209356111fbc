"""Control: consumer-side delayed nacks, read from the control topic (contract section 5)."""
