//! Marks the tests whose tools are missing (tshark; root, ip and nft for the
//! network-namespace fault tests; redis-cli for the cache walk-through) as ignored, with the reason (see `rdmx-testenv`).
use rdmx_testenv::{probe, Need};

fn main() {
    probe(&[
        ("tshark", &[Need::Program("tshark", &["-v"])]),
        ("redis", &[Need::Program("redis-cli", &["--version"])]),
        (
            "netns",
            &[
                Need::Root,
                Need::Program("ip", &["-V"]),
                Need::Program("nft", &["-v"]),
            ],
        ),
    ]);
}
