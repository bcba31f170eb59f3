//! Marks the tests whose tools are missing (root and dumpcap for the exact
//! IPv4 capture; cc and libibverbs-dev for the fake libibverbs) as ignored,
//! with the reason (see `rdmx-testenv`).
use rdmx_testenv::{probe, Need};

fn main() {
    probe(&[
        ("dumpcap", &[Need::Root, Need::Program("dumpcap", &["-v"])]),
        (
            "fake_verbs",
            &[
                Need::Program("cc", &["--version"]),
                Need::CHeader("infiniband/verbs.h"),
            ],
        ),
    ]);
}
