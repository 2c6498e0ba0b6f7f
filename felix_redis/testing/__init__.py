"""Helpers for testing with felix-redis: private redis-server processes and topologies."""

from felix_redis.testing.server import RedisServer, free_port, redis_server_binary

__all__ = ["RedisServer", "free_port", "redis_server_binary"]
