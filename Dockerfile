# metakv node image: one image serves every node; each container is configured only through
# METAKV_* environment variables (see docker-compose.yml and docs/api.md).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/metakv
COPY pyproject.toml README.md ./
COPY raft ./raft
COPY storage ./storage
COPY app ./app
COPY pipeline ./pipeline
COPY loadtest ./loadtest
RUN pip install . \
    && useradd --system --uid 10001 --user-group --home-dir /data --no-create-home metakv \
    && mkdir -p /data \
    && chown metakv:metakv /data

USER metakv
VOLUME ["/data"]
EXPOSE 8001 9001

# Listening on every interface, a node refuses to start on the public built-in cluster secret:
# set METAKV_CLUSTER_SECRET (16 characters or more) or peer TLS (docs/security.md).
ENV METAKV_DATA_DIR=/data \
    METAKV_LISTEN_HTTP=0.0.0.0:8001 \
    METAKV_LISTEN_RAFT=0.0.0.0:9001

HEALTHCHECK --interval=5s --timeout=3s --start-period=10s --retries=5 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8001/readyz', timeout=2)"]

ENTRYPOINT ["metakv"]
CMD ["serve"]
