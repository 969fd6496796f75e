# syntax=docker/dockerfile:1
# Multi-stage build: compile with the Rust toolchain, run on a slim Debian as a non-root
# user. The sample config in config/ is copied to /etc/fleetgate/fleetgate.toml; mount
# your own over it (or set FLEETGATE_* variables).

FROM rust:1.95-bookworm AS build
WORKDIR /src
# Dependencies first, so source edits do not rebuild them. The workspace's second
# package (the simulated vLLM behind `fleetgate demo`) is needed to build the binary.
COPY Cargo.toml Cargo.lock ./
COPY tests/mock-vllm/Cargo.toml ./tests/mock-vllm/
RUN mkdir -p src/bin/fleetgate tests/mock-vllm/src benches \
 && echo 'fn main() {}' > src/bin/fleetgate/main.rs \
 && echo 'fn main() {}' > tests/mock-vllm/src/main.rs \
 && echo 'fn main() {}' > benches/overhead.rs \
 && touch src/lib.rs tests/mock-vllm/src/lib.rs \
 && cargo build --release --locked --bin fleetgate \
 && rm -rf src benches tests/mock-vllm/src
COPY src ./src
COPY benches ./benches
COPY tests/mock-vllm/src ./tests/mock-vllm/src
# sqlx embeds the migrations at compile time.
COPY migrations ./migrations
# Touch the sources so cargo rebuilds the crates themselves over the placeholder build.
RUN touch src/bin/fleetgate/main.rs src/lib.rs tests/mock-vllm/src/lib.rs \
 && cargo build --release --locked --bin fleetgate

FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 --home-dir /var/lib/fleetgate --create-home fleetgate
COPY --from=build /src/target/release/fleetgate /usr/local/bin/
COPY config/fleetgate.toml /etc/fleetgate/fleetgate.toml
USER fleetgate
WORKDIR /var/lib/fleetgate
ENV FLEETGATE_CONFIG=/etc/fleetgate/fleetgate.toml \
    FLEETGATE_LISTEN=0.0.0.0:8080 \
    FLEETGATE_DATABASE_URL=sqlite:///var/lib/fleetgate/fleetgate.db \
    FLEETGATE_LOG_FORMAT=json
EXPOSE 8080
ENTRYPOINT ["fleetgate"]
CMD ["serve"]
