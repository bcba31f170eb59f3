//! Marks the interop tests whose independent tool (tshark, scapy) is missing
//! as ignored, with the reason (see `rdmx-testenv`).
use rdmx_testenv::{probe, Need};

fn main() {
    probe(&[
        ("tshark", &[Need::Program("tshark", &["-v"])]),
        ("scapy", &[Need::PythonModule("scapy.contrib.roce")]),
    ]);
}
