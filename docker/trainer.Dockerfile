# The trainer image: torch, speculators==0.9.0, dspark and Mooncake (its mooncake_master runs
# from this image too). scripts/docker-build.sh builds it offline: DEPS_IMAGE holds the tested
# .venv's packages in /opt/dspark, on the base both images share (dspark-deps:common-TAG), and this
# file adds dspark's own wheel and the entrypoint from the small context build/docker/trainer:
#   docker build -f docker/trainer.Dockerfile --build-arg DEPS_IMAGE=dspark-deps:trainer-latest build/docker/trainer
# Several GPUs: the compose step runs `torchrun --nproc-per-node $TRAIN_NPROC dspark train ...`.
ARG DEPS_IMAGE=dspark-deps:trainer-latest
FROM ${DEPS_IMAGE}
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
