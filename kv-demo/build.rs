//! Marks the tests that need Redis's own programs (redis-server for the
//! differential test, redis-cli and redis-benchmark as unmodified clients)
//! as ignored where they are missing, with the reason (see `rdmx-testenv`).
use rdmx_testenv::{probe, Need};

fn main() {
    probe(&[(
        "redis",
        &[
            Need::Program("redis-server", &["--version"]),
            Need::Program("redis-cli", &["--version"]),
            Need::Program("redis-benchmark", &["--version"]),
        ],
    )]);
}
