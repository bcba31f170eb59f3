//! Command capsules: any 64-byte SQE with any data goes through the target's
//! Connect and command execution without a panic, and answers a status.
#![no_main]

use std::sync::Arc;

use libfuzzer_sys::fuzz_target;
use rdmx_block::backend::RamBackend;
use rdmx_block::nvme::command::Sqe;
use rdmx_block::target::{Queue, Target, TargetConfig};

fuzz_target!(|data: &[u8]| {
    if data.len() < 128 {
        return;
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    rt.block_on(async {
        let t = Target::new(TargetConfig::default());
        t.add_namespace(Arc::new(RamBackend::new(1 << 20).unwrap())).unwrap();
        let mut q = Queue::new(None);
        // First SQE as a Connect with the fuzzer's data, then the second SQE
        // as a command on whatever queue that made.
        let mut connect = Sqe::parse(data[..64].try_into().unwrap());
        connect.opcode = 0x7f;
        let _ = t.connect(&mut q, &connect, &data[128..]);
        let sqe = Sqe::parse(data[64..128].try_into().unwrap());
        if sqe.opcode == 0x0C {
            return; // Asynchronous Event Requests wait for ever, by design.
        }
        let payload = bytes::Bytes::copy_from_slice(&data[128..]);
        let _ = t.execute(&q, &sqe, payload).await;
        t.queue_closed(&q);
    });
});
