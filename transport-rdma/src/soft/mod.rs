//! The soft provider: a userspace RoCEv2 device over UDP.

mod clock;
mod cq;
mod device;
mod gather;
mod timer;

pub use device::{on_thread_park, DeviceStats, SoftConfig, SoftRoce, ROCEV2_PORT};
