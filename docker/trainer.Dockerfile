# The trainer image: torch, speculators==0.9.0, dspark and Mooncake (its mooncake_master runs
# from this image too). scripts/docker-build.sh builds it offline from a host wheelhouse:
#   docker build -f docker/trainer.Dockerfile --build-arg BASE_IMAGE=... build/docker/trainer
# Several GPUs: the compose step runs `torchrun --nproc-per-node $TRAIN_NPROC dspark train ...`.
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
COPY wheels /wheels
# The lock is the tested .venv, frozen: install exactly it, with no resolver and no index.
RUN python3 -m venv /opt/dspark \
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
 && /opt/dspark/bin/python -c "import dspark.train, speculators, mooncake.store"
ENV PATH=/opt/dspark/bin:$PATH PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 DSPARK_CACHE_DIR=/cache
USER dspark
WORKDIR /cache
ENTRYPOINT ["dspark"]
CMD ["--help"]
