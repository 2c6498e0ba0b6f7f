"""``python -m felix_redis.testing sentinel|cluster``: the topology launcher."""

from felix_redis.testing.topology import main

raise SystemExit(main())
