//! A queue pair fed arbitrary packets: never panics, and never asks memory
//! for anything outside a region it did not first check (every write/read it
//! issues after its own R_Key/range check must succeed).
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use rdmx_roce_proto::{Atomic, MemError, Memory, Need, Packet, Qp, QpConfig, VecMemory};

struct Checked(VecMemory);

impl Memory for Checked {
    fn check(&self, rkey: u32, va: u64, len: u64, need: Need) -> Result<(), MemError> {
        self.0.check(rkey, va, len, need)
    }
    fn write(&mut self, rkey: u32, va: u64, data: &[u8]) -> Result<(), MemError> {
        let r = self.0.write(rkey, va, data);
        assert!(r.is_ok(), "write outside a checked range: {r:?}");
        r
    }
    fn read(&self, rkey: u32, va: u64, len: u64) -> Result<Bytes, MemError> {
        let r = self.0.read(rkey, va, len);
        assert!(r.is_ok(), "read outside a checked range: {r:?}");
        r
    }
    fn atomic(&mut self, rkey: u32, va: u64, op: Atomic) -> Result<u64, MemError> {
        self.0.atomic(rkey, va, op)
    }
}

fuzz_target!(|data: &[u8]| {
    let mut mem = VecMemory::default();
    mem.add(0x10, 0x1000, vec![0; 4096]);
    mem.add(0x20, 0x8000, vec![0; 256]);
    mem.regions[1].write = false;
    let mut mem = Checked(mem);
    // Bit 7 of the first byte: selective repeat (packets kept out of order,
    // WRITE packets placed on arrival, selective NAKs).
    let selective_repeat = data.first().is_some_and(|b| b & 0x80 != 0);
    let cfg = QpConfig { pmtu: 256, selective_repeat, ..QpConfig::default() };
    let mut qp = Qp::new(cfg, 7);
    qp.connect(9, 0, 0).unwrap();
    for i in 0..4 {
        qp.post_recv(i, 600).unwrap();
    }
    // Input: chunks of [flags, len, bytes...]; flag bit 0 pins the PSN to the
    // expected one so the fuzzer reaches deep responder states.
    let mut rest = data;
    let mut now = 0;
    while rest.len() >= 2 {
        let (flags, len) = (rest[0], rest[1] as usize);
        rest = &rest[2..];
        let take = len.min(rest.len());
        let (chunk, tail) = rest.split_at(take);
        rest = tail;
        if let Ok(mut p) = Packet::decode(chunk) {
            p.bth.dest_qp = 7;
            if flags & 1 != 0 {
                p.bth.psn = qp.expected_psn();
            }
            qp.handle_packet(now, &p, flags & 2 != 0, &mut mem);
        }
        now += 1_000;
        qp.handle_timeout(now);
        while qp.poll_transmit(now).is_some() {}
        while qp.poll_completion().is_some() {}
    }
});
