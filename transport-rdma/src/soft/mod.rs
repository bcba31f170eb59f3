//! The soft provider: a userspace RoCEv2 device over UDP.

mod clock;
mod config;
mod cq;
mod datagram;
mod device;
mod gather;
mod timer;

pub use config::{SoftConfig, ROCEV2_PORT};
pub use device::{on_thread_park, DeviceStats, SoftRoce};
