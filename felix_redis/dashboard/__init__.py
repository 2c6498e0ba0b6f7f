"""felix-redis's web dashboard (``felixctl dashboard``; docs/dashboard.md).

Needs the ``dashboard`` extra: ``pip install 'felix-redis[dashboard]'`` (Starlette,
uvicorn, Jinja2). Every asset ships in the package: the pages work offline."""

from __future__ import annotations

from felix_redis.dashboard.app import check_bind, create_app

__all__ = ["check_bind", "create_app"]
