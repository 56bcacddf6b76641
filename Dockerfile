# The code location's image: the gRPC code server (`dagster api grpc`) and the delivery, replay and backfill
# runs launched from it (the Helm chart's user-code deployment and K8sRunLauncher's run pods run this image).
# docs/deployment.md says what each process needs. Not built by the tests (no Docker where they run):
# tests/test_deployment.py checks this file against pyproject.toml and workspace.yaml.
#
#   docker build -t pgstream-dagster:0.1.0 .
#   docker build --build-arg PGSTREAM_EXTRAS=k8s,redis -t pgstream-dagster:0.1.0 .   # only the sinks you use

# bookworm: Debian's Java 17 (trixie, the next, has none)
FROM python:3.12-slim-bookworm

# Java 17: the JVM of the Spark driver a run starts (ordering: by_key streams, backfills, a replay too large
# to read directly); the executors of local Spark are this image's Python
RUN apt-get update \
    && apt-get install -y --no-install-recommends openjdk-17-jre-headless procps \
    && rm -rf /var/lib/apt/lists/*

# the sinks' extras, and k8s (dagster-k8s) for the Helm chart's K8sRunLauncher; never dev
ARG PGSTREAM_EXTRAS=k8s,metrics,redis,rabbitmq,nats,kafka,mqtt,aws,lake

WORKDIR /opt/pgstream
COPY pyproject.toml README.md ./
COPY pgstream_dagster ./pgstream_dagster
COPY sql ./sql
RUN pip install --no-cache-dir ".[${PGSTREAM_EXTRAS}]" && rm -rf /opt/pgstream/*

# pgstream.yaml and dagster.yaml come from the deployment (a ConfigMap each, say); DAGSTER_POSTGRES_URL and
# the database URLs from its secrets
ENV PGSTREAM_CONFIG=/etc/pgstream/pgstream.yaml \
    DAGSTER_HOME=/opt/dagster/dagster_home \
    PYTHONUNBUFFERED=1
RUN useradd --create-home --uid 10001 pgstream && mkdir -p /etc/pgstream /opt/dagster/dagster_home \
    && chown pgstream /opt/dagster/dagster_home
USER pgstream
WORKDIR /home/pgstream

EXPOSE 3030
CMD ["dagster", "api", "grpc", "--module-name", "pgstream_dagster.definitions", "--host", "0.0.0.0", "--port", "3030", "--location-name", "pgstream"]
