"""The operator's tools: admin (a URL to a store), the CLI, the panel, the purge, conformance."""
