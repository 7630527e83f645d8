"""The values every part shares: records, exceptions, problems, settings and events."""
