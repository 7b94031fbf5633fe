# Builds every onejob binary into one small image; compose.yaml picks the command.
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked --workspace --bins

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/onejob /src/target/release/onejob-worker \
     /src/target/release/onejob-producer /src/target/release/onejob-mock-provider /usr/local/bin/
USER nobody
# Loopback by default: compose.yaml (and any manifest) names the address it
# exposes, on its own network.
CMD ["onejob-worker", "--http", "127.0.0.1:9090"]
