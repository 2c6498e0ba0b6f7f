# felixctl image for compose.yaml (the quickstart) and for running felixctl anywhere:
#   docker build -t felixctl . && docker run --rm -e FELIX_REDIS_URL=... felixctl --help
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY pyproject.toml README.md ./
COPY lua ./lua
COPY felix_redis ./felix_redis
COPY felixctl ./felixctl
# the metrics extra: `felixctl metrics` and `worker --metrics-listen` need prometheus-client
RUN pip install '.[metrics]' && rm -rf /src

COPY docker/init.sh /usr/local/bin/felix-compose-init
RUN chmod 0755 /usr/local/bin/felix-compose-init \
    && useradd --system --no-create-home --shell /usr/sbin/nologin felix
USER felix
WORKDIR /

ENTRYPOINT ["felixctl"]
CMD ["--help"]
