# A container for Idem: built in one stage, run in a small one as a user that is not root.
#
#   docker build -t idem .
#   docker run -p 8080:8080 -p 8081:8081 -v $PWD/idem.toml:/etc/idem/idem.toml:ro \
#       -v idem-data:/var/lib/idem idem
#
# The config must listen on 0.0.0.0 (deploy/single-node.toml does) for the ports to be reached
# from outside the container; keep the admin listener on a network only operators reach.

FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked --bin idem

FROM debian:bookworm-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates curl \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --home-dir /var/lib/idem --shell /usr/sbin/nologin idem \
    && install -d -o idem -g idem -m 0750 /var/lib/idem /etc/idem
COPY --from=build /src/target/release/idem /usr/local/bin/idem
COPY deploy/single-node.toml /etc/idem/idem.toml
USER idem
WORKDIR /var/lib/idem
EXPOSE 8080 8081
# /healthz answers 200 while the process serves (readiness, the store included, is /readyz).
HEALTHCHECK --interval=10s --timeout=2s --start-period=10s --retries=3 \
    CMD curl -fsS http://127.0.0.1:8081/healthz || exit 1
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/idem"]
CMD ["serve", "--config", "/etc/idem/idem.toml"]
