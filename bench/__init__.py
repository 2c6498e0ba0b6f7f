"""Benchmark harness: felix-redis against raw Redis Streams and peer queues.

Run ``python -m bench --help``; the method is in docs/benchmarks.md.
"""
