# primaplug for Linux desktops: a node (the default command) or a head (run, serve, dashboard, plan).
# docs/docker.md has the commands; in short:
#
#   docker build -t primaplug .                                   # CPU, on the official python image
#   docker build -t primaplug --build-arg BASE=local/debian:bookworm .   # any Debian/Ubuntu base, Python or not
#   docker build -t primaplug:cuda --build-arg GPU=cuda \
#       --build-arg BUILD_BASE=nvidia/cuda:12.6.3-devel-ubuntu24.04 \
#       --build-arg RUNTIME_BASE=nvidia/cuda:12.6.3-runtime-ubuntu24.04 \
#       --build-arg PRIMAPLUG_CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=86 -DGGML_NATIVE=OFF" .   # untested here
#   docker run -d -v "$PWD/model.gguf:/models/model.gguf:ro" -v "$PWD/keys:/keys:ro" \
#       -p 7000-7001:7000-7001 primaplug                          # a node on :7000 (control) and :7001 (ring)
#
# Extra CA certificates: docker/certs/*.crt (docker/certs/README.md).
# The two stages must have the same Python at the same path: the runtime stage takes the build stage's venv.

ARG BASE=python:3.12-slim-bookworm
ARG BUILD_BASE=${BASE}
ARG RUNTIME_BASE=${BASE}

FROM ${BUILD_BASE} AS build
# cpu or cuda (scripts/build_engine.py --gpu); extra CMake flags, e.g. -DGGML_NATIVE=OFF for an image that runs
# on other CPUs than the one it was built on (the default build uses every instruction of this one)
ARG GPU=cpu
ARG PRIMAPLUG_CMAKE_ARGS=""
ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PRIMAPLUG_CACHE=/tmp/primaplug-cache
COPY docker/base-setup.sh /usr/local/bin/primaplug-base-setup
COPY docker/certs/ /tmp/certs/
RUN primaplug-base-setup build

# the engine first, in a layer of its own: it is rebuilt only when the patches or the build's code change
WORKDIR /src
COPY scripts/build_engine.py scripts/
COPY primaplug/engine/build.py primaplug/engine/
COPY patches/ patches/
RUN python3 -m venv /opt/primaplug \
    && /opt/primaplug/bin/python scripts/build_engine.py --gpu "$GPU" --python /opt/primaplug/bin/python \
    && rm -rf "$PRIMAPLUG_CACHE"
COPY . .
RUN /opt/primaplug/bin/python -m pip install '.[server,dashboard]'


FROM ${RUNTIME_BASE}
ARG GPU=cpu
# the user the processes run as; the base's own user of that uid (Ubuntu 24.04's "ubuntu") gives way
ARG UID=1000
ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt \
    PATH=/opt/primaplug/bin:$PATH \
    HOME=/home/primaplug \
    PRIMAPLUG_CACHE=/home/primaplug/.cache/primaplug \
    PYTHONUNBUFFERED=1
COPY docker/base-setup.sh /usr/local/bin/primaplug-base-setup
COPY docker/certs/ /tmp/certs/
# /home/primaplug/.cache holds the caches (device profiles, repacked copies of models, the bundled model): it and
# the home are writable by any --user. A fresh volume mounted on a folder of the image takes its owner and mode, so
# a cache volume is writable too, and a key volume on /keys (owned by the user) is writable for compose.yaml's keygen
RUN primaplug-base-setup runtime \
    && if getent passwd "$UID" >/dev/null; then userdel --remove "$(getent passwd "$UID" | cut -d: -f1)"; fi \
    && useradd --uid "$UID" --user-group --home-dir /home/primaplug --create-home --shell /bin/sh primaplug \
    && mkdir -p /home/primaplug/.cache /models /keys \
    && chown primaplug: /home/primaplug/.cache /keys \
    && chmod 1777 /home/primaplug /home/primaplug/.cache
COPY --from=build /opt/primaplug /opt/primaplug
# the venv runs on this base (same Python); a CUDA engine loads only where the driver is (docker run --gpus)
RUN primaplug --help >/dev/null && { [ "$GPU" != cpu ] || python -c "import llama_cpp"; }

USER primaplug
WORKDIR /home/primaplug
EXPOSE 7000 7001
# a Hello over the node's control channel (it does not count as a head's word for --release-after); for a node on
# another port or key file, or a head container, override it (docker run --health-cmd / --no-healthcheck)
HEALTHCHECK --interval=30s --timeout=10s --start-period=30s --retries=3 \
    CMD ["primaplug", "health", "--keys", "/keys/cluster.key", "127.0.0.1:7000"]
ENTRYPOINT ["primaplug"]
CMD ["node", "--model", "/models/model.gguf", "--listen", "0.0.0.0:7000", "--keys", "/keys/cluster.key"]
