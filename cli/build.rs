//! Marks the tests whose tools are missing (tshark; root, ip and nft for the
//! network-namespace fault tests; redis-cli for the cache walk-through; the
//! NBD clients for the block export) as ignored, with the reason (see `rdmx-testenv`).
use rdmx_testenv::{probe, Need};

fn main() {
    probe(&[
        ("tshark", &[Need::Program("tshark", &["-v"])]),
        ("redis", &[Need::Program("redis-cli", &["--version"])]),
        (
            "nbdtools",
            &[
                Need::Program("qemu-img", &["--version"]),
                Need::Program("qemu-io", &["--version"]),
                Need::Program("nbdinfo", &["--version"]),
                Need::Program("nbdcopy", &["--version"]),
                Need::Program("fio", &["--enghelp=nbd"]),
            ],
        ),
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
