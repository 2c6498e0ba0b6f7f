"""felix-redis: Felix-style work queues on Redis."""
