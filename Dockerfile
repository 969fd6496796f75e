# syntax=docker/dockerfile:1
# Multi-stage build: compile with the Rust toolchain, run on a slim Debian as a non-root
# user. Two images come out of this file:
#
#   docker build -t fleetgate .                       # the gateway (the default, last stage)
#   docker build -t mock-vllm --target mock-vllm .    # the simulated vLLM of tests/mock-vllm
#
# The gateway image's config is deploy/docker/fleetgate.toml, copied to
# /etc/fleetgate/fleetgate.toml: API on 0.0.0.0:8080, /metrics and the probes on
# 0.0.0.0:9090, SQLite in the /var/lib/fleetgate volume, one sample upstream at
# http://host.docker.internal:8000. Mount your own config over it; FLEETGATE_* variables
# override single values (docs/configuration.md). See docs/operations.md, Deploying.

FROM rust:1.95-bookworm AS build
WORKDIR /src
# A stripped release binary: no symbol table or debug info (Cargo.toml's release
# profile keeps line tables for local builds; here they would only add megabytes).
# Panic messages still name the file and line; backtraces lose their symbols.
ENV CARGO_PROFILE_RELEASE_DEBUG=false \
    CARGO_PROFILE_RELEASE_STRIP=symbols
# Dependencies first, so source edits do not rebuild them. The workspace's second
# package (the simulated vLLM behind `fleetgate demo`) is needed to build the binary;
# the others (the admission model and the benchmark's bare proxy) only have to be
# there for cargo to load the workspace: a manifest and an empty target each.
COPY Cargo.toml Cargo.lock ./
COPY tests/mock-vllm/Cargo.toml ./tests/mock-vllm/
COPY model/admission/Cargo.toml ./model/admission/
COPY benches/bare-hyper/Cargo.toml ./benches/bare-hyper/
RUN mkdir -p src/bin/fleetgate tests/mock-vllm/src model/admission/src benches/bare-hyper/src \
 && echo 'fn main() {}' > src/bin/fleetgate/main.rs \
 && echo 'fn main() {}' > tests/mock-vllm/src/main.rs \
 && echo 'fn main() {}' > model/admission/src/main.rs \
 && echo 'fn main() {}' > benches/overhead.rs \
 && echo 'fn main() {}' > benches/bare-hyper/src/main.rs \
 && touch src/lib.rs tests/mock-vllm/src/lib.rs model/admission/src/lib.rs \
 && cargo build --release --locked --bin fleetgate \
 && rm -rf src benches tests/mock-vllm/src
COPY src ./src
COPY benches ./benches
COPY tests/mock-vllm/src ./tests/mock-vllm/src
# sqlx embeds the migrations at compile time.
COPY migrations ./migrations
# Touch the sources so cargo rebuilds the crates themselves over the placeholder build.
RUN touch src/bin/fleetgate/main.rs src/lib.rs tests/mock-vllm/src/main.rs tests/mock-vllm/src/lib.rs \
 && cargo build --release --locked --bin fleetgate

# The simulated vLLM as a binary of its own; only built for `--target mock-vllm`.
FROM build AS build-mock
RUN cargo build --release --locked --bin mock-vllm

FROM debian:bookworm-slim AS runtime-base
# Unpinned on purpose: ca-certificates should be the base release's current one.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/*

# A simulated vLLM node (tests/mock-vllm): the OpenAI completions API, /health,
# /v1/models and /metrics of a vLLM server, with no GPU and no model. For trying the
# deploy recipes (deploy/compose/), never for serving. It stops on SIGINT only, hence
# STOPSIGNAL (SIGTERM to PID 1 without a handler would do nothing until the kill).
FROM runtime-base AS mock-vllm
RUN groupadd --system --gid 10002 mock-vllm \
 && useradd --system --uid 10002 --gid 10002 --no-create-home mock-vllm
COPY --from=build-mock /src/target/release/mock-vllm /usr/local/bin/
USER 10002:10002
EXPOSE 8000
STOPSIGNAL SIGINT
ENTRYPOINT ["mock-vllm"]
CMD ["--listen", "0.0.0.0:8000"]

# The gateway (the default target).
FROM runtime-base
RUN groupadd --system --gid 10001 fleetgate \
 && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/fleetgate --create-home fleetgate
COPY --from=build /src/target/release/fleetgate /usr/local/bin/
COPY deploy/docker/fleetgate.toml /etc/fleetgate/fleetgate.toml
# Numeric, so that Kubernetes' runAsNonRoot can verify it without /etc/passwd.
USER 10001:10001
WORKDIR /var/lib/fleetgate
# The SQLite store (keys, usage ledger, request log) of the image's config. A volume, so
# it outlives the container: `docker run -v fleetgate-data:/var/lib/fleetgate …`. A named
# volume takes the directory's owner (uid 10001) from the image; a host directory
# mounted here must be writable by uid 10001.
VOLUME ["/var/lib/fleetgate"]
# Only the config's path is set here: listen addresses, database URL and log format are
# in the config file, so a config mounted over it is taken as written (a FLEETGATE_*
# variable set in the image would silently override it).
ENV FLEETGATE_CONFIG=/etc/fleetgate/fleetgate.toml
# 8080: the API (`listen`). 9090: `ops_listen`, only /metrics, /health, /ready and
# /live, for the scraper and the probes.
EXPOSE 8080 9090 9091
# The image has no curl or wget, and fleetgate no probe subcommand: bash (in every
# Debian image) speaks HTTP over /dev/tcp. Healthy while GET /ready on the ops port
# answers 200: 503 while the store or Redis does not answer or shutdown has begun
# (docs/operations.md, "Health, readiness and liveness"). A config that
# moves ops_listen off port 9090 needs its own check (`docker run --health-cmd`, compose
# `healthcheck:`).
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
  CMD ["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/9090 && printf 'GET /ready HTTP/1.1\\r\\nHost: localhost\\r\\nConnection: close\\r\\n\\r\\n' >&3 && read -r -t 2 _ status _ <&3 && [ \"$status\" = 200 ]"]
ENTRYPOINT ["fleetgate"]
CMD ["serve"]
