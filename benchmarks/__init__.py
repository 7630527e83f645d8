"""Benchmarks of idempotency-mw: scripts that print figures and write Markdown, not tests.

Run one with ``python -m benchmarks.<name> --help`` from the repository root, or everything at
a reduced size with ``python -m benchmarks.run_all`` (writes ``benchmarks/RESULTS.md``).
"""
