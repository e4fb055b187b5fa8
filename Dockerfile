# A container for Idem: built in one stage, run in a small one as a user that is not root.
#
#   docker build --build-arg IDEM_COMMIT=$(git rev-parse --short=12 HEAD) -t idem .
#   docker run -d -p 8080:8080 -p 127.0.0.1:8081:8081 \
#       -e IDEM_ADMIN_TOKEN=… -v $PWD/idem.toml:/etc/idem/idem.toml:ro -v idem-data:/var/lib/idem idem
#
# The config must listen on 0.0.0.0 (deploy/single-node.toml does) for the ports to be reached
# from outside the container. Publish the admin port on the host's loopback only (as above), or
# on a network only operators reach: never on every interface.
#
# The base images are named by tag here. Pin them by digest in your registry's mirror
# (`--build-arg RUNTIME_IMAGE=debian:bookworm-slim@sha256:…`) for builds that repeat.
# `.ci/image` builds this same file from a Debian base made by mmdebstrap and the binary the
# host's cargo built (`--build-arg BINARY=prebuilt`), then runs it.

ARG RUST_IMAGE=rust:1-bookworm
ARG RUNTIME_IMAGE=debian:bookworm-slim
# `build` compiles here; `prebuilt` takes target/release/idem from the build context.
ARG BINARY=build

FROM ${RUST_IMAGE} AS build
ARG IDEM_COMMIT=unknown
ENV IDEM_COMMIT=${IDEM_COMMIT}
WORKDIR /src
COPY . .
RUN cargo build --release --locked --bin idem \
    && install -D -m 0755 target/release/idem /out/usr/local/bin/idem \
    && strip /out/usr/local/bin/idem

FROM scratch AS prebuilt
COPY target/release/idem /out/usr/local/bin/idem

FROM ${BINARY} AS binary

FROM ${RUNTIME_IMAGE}
ARG IDEM_COMMIT=unknown
LABEL org.opencontainers.image.title="idem" \
      org.opencontainers.image.description="An idempotency-aware request broker" \
      org.opencontainers.image.revision="${IDEM_COMMIT}" \
      org.opencontainers.image.licenses="Apache-2.0"
# ca-certificates: the public roots an https upstream or collector is checked against.
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --home-dir /var/lib/idem --shell /usr/sbin/nologin idem \
    && install -d -o idem -g idem -m 0750 /var/lib/idem /etc/idem
COPY --from=binary /out/usr/local/bin/idem /usr/local/bin/idem
COPY deploy/single-node.toml /etc/idem/idem.toml
USER idem
WORKDIR /var/lib/idem
ENV IDEM_CONFIG=/etc/idem/idem.toml
VOLUME ["/var/lib/idem"]
EXPOSE 8080 8081
# `idem health` asks /healthz on the admin listener the config names, in its scheme: no curl.
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 CMD ["/usr/local/bin/idem", "health"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/idem"]
CMD ["serve"]
