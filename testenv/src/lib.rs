//! # rdmx-testenv
//!
//! Some of rdmx's tests check our code against independent tools (tshark's
//! dissector, scapy's ICRC, the kernel through network namespaces) that a
//! fresh machine may not have. Such a test must not pass silently there. A
//! crate's `build.rs` calls [`probe`] with what its tests need; for each need
//! that is missing it sets a cfg (`rdmx_missing_<name>`), and the test is
//! marked
//!
//! ```text
//! #[cfg_attr(rdmx_missing_tshark, ignore = "needs tshark (apt-get install tshark)")]
//! ```
//!
//! so `cargo test` lists it as `ignored, needs tshark …` and counts it in the
//! summary's "N ignored". Under CI (`CI` set) no cfg is set: the tests run and
//! fail loudly if a tool is missing, because CI installs every one.
//!
//! Probes run when the build script runs: after a change to `PATH`, `CI` or
//! the build script. After installing a tool, `cargo clean -p <crate>` (or
//! touching its `build.rs`) probes again.

#![deny(unsafe_op_in_unsafe_fn)]
#![forbid(unsafe_code)]

use std::process::{Command, Stdio};

/// Something a test needs from the machine.
#[derive(Clone, Copy, Debug)]
pub enum Need {
    /// A program that runs with these arguments and exits 0.
    Program(&'static str, &'static [&'static str]),
    /// A Python module `python3` can import.
    PythonModule(&'static str),
    /// Root (user id 0), for network namespaces and raw captures.
    Root,
    /// A C header the system compiler finds (e.g. `infiniband/verbs.h`).
    CHeader(&'static str),
}

impl Need {
    /// True if this machine has it.
    pub fn present(self) -> bool {
        let quiet = |c: &mut Command| {
            c.stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        };
        match self {
            Need::Program(p, args) => quiet(Command::new(p).args(args)),
            Need::PythonModule(m) => {
                quiet(Command::new("python3").args(["-c", &format!("import {m}")]))
            }
            Need::Root => std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
                s.lines()
                    .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0"))
            }),
            Need::CHeader(h) => std::path::Path::new("/usr/include").join(h).exists(),
        }
    }
}

/// Probe every `(cfg name, needs)` pair; print the cargo directives that set
/// `rdmx_missing_<name>` where any need is absent (never under CI).
pub fn probe(checks: &[(&str, &[Need])]) {
    println!("cargo::rerun-if-env-changed=PATH");
    println!("cargo::rerun-if-env-changed=CI");
    let ci = std::env::var_os("CI").is_some();
    for (name, needs) in checks {
        let cfg = format!("rdmx_missing_{name}");
        println!("cargo::rustc-check-cfg=cfg({cfg})");
        let missing: Vec<String> = needs
            .iter()
            .filter(|n| !n.present())
            .map(|n| format!("{n:?}"))
            .collect();
        if !missing.is_empty() && !ci {
            println!("cargo::rustc-cfg={cfg}");
            println!(
                "cargo::warning=tests needing {name} are ignored: missing {}",
                missing.join(", ")
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probes_tell_present_from_absent() {
        assert!(Need::Program("sh", &["-c", "exit 0"]).present());
        assert!(!Need::Program("sh", &["-c", "exit 3"]).present());
        assert!(!Need::Program("rdmx-no-such-program-anywhere", &[]).present());
        assert!(!Need::CHeader("rdmx/no-such-header.h").present());
        assert!(
            Need::CHeader("stdio.h").present() || !Need::Program("cc", &["--version"]).present()
        );
    }
}
