# epp container image: the endpoint picker (`epp serve`) and the vLLM simulator (`epp sim`).
#
#   docker build -t epp .
#   docker run --rm epp --help
#
# BASE_IMAGE is any Debian-like image with python3 and python3-venv (3.11+). The slow test tier
# (make test-compose) builds on a base it makes itself with debootstrap, because no registry can
# be reached there; both stages must use the same base so the virtualenv's interpreter path holds.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
# Every dependency ships manylinux wheels: the slim base needs no compiler in either stage.
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/epp
COPY pyproject.toml README.md /src/
COPY epp /src/epp
RUN /opt/epp/bin/pip install /src

FROM ${BASE_IMAGE}
LABEL org.opencontainers.image.title="epp" \
      org.opencontainers.image.description="Endpoint picker for LLM inference fleets (Envoy ext_proc)" \
      org.opencontainers.image.source="https://github.com/epp/epp"
COPY --from=build /opt/epp /opt/epp
# A fixed numeric uid so Kubernetes' runAsNonRoot can verify it without a passwd lookup.
RUN groupadd --gid 10001 epp && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin epp
USER 10001:10001
ENV PATH=/opt/epp/bin:$PATH PYTHONUNBUFFERED=1
# ext_proc gRPC, gRPC health, Prometheus metrics and /debug; the simulator listens on 8000.
EXPOSE 9002 9003 9090 8000
ENTRYPOINT ["epp"]
CMD ["serve", "--config", "/etc/epp/epp.yaml"]
