//! # rdmx-kv
//!
//! A distributed in-memory cache on rdmx. Each node keeps its items in memory
//! registered with its rdmx domain; clients GET with one-sided reads (bucket,
//! then item, then a self-check) that run no node code, and write through
//! rdmx-rpc. Keys map to nodes by rendezvous hashing; a node that stops
//! answering is marked down and its keys go to the next node until it is back.
//! A RESP2 gateway lets unmodified Redis clients use the cluster.

#![deny(unsafe_op_in_unsafe_fn)]
#![forbid(unsafe_code)]

pub mod bench;
pub mod client;
pub mod gateway;
pub mod layout;
pub mod node;
pub mod pointers;
pub mod resp;
pub mod store;

pub use client::{Client, ClientConfig, GetPath, KvError};
pub use node::{Node, NodeInfo, NodeStats, Ttl};
pub use store::{Cond, Store};
