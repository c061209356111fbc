"""The Spark audit of every message's fate (filled in by the audit issue)."""
