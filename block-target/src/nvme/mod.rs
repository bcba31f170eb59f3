//! NVMe data structures shared by every transport: commands and
//! completions, status values, Identify data and log pages.

pub mod command;
pub mod identify;
pub mod status;
