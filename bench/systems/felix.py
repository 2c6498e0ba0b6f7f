"""felix-redis placeholder (filled in below)."""
