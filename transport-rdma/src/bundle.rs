//! Bundles: several small messages carried by one SEND (the wire format,
//! public for fuzzing and for peers written elsewhere).
//!
//! On RDMA every message is a SEND, and every SEND costs the responder a
//! receive, an acknowledgement and a completion, and at least one packet
//! (IBTA 9.2.5: a message of more than one PMTU is several). A batch of
//! answers from [`rdmx_core::Connection::send_many`] (an RPC server's, or a
//! client's burst of calls) would go as that many SENDs: 64 answers of 4 KiB
//! were 128 packets of two sizes (4096 and the last few bytes), which the
//! soft engine cannot segment together, so 128 system calls. Bundled, they
//! are 65 full-size packets in one segmented send.
//!
//! A bundle is an ordinary SEND with Immediate Data (IBTA 9.4.3) whose
//! immediate is [`BUNDLE_IMM`]; its payload is each message in turn, prefixed
//! by its length (u32, little endian). Peers announce that they take
//! bundles in the bootstrap parameters (`FLAG_BUNDLES`); a sender bundles
//! only for a peer that does. The receiver hands the messages out one by
//! one, in order, and returns the bundle's receive and credits once the
//! application has taken the last of them.

use bytes::{BufMut, Bytes, BytesMut};

/// The immediate data that marks a SEND as a bundle ("RDMB").
pub const BUNDLE_IMM: u32 = 0x5244_4d42;

/// A message this large or larger always goes as a SEND of its own: copying
/// it into a bundle would cost more than the packets it saves.
pub const PART_MAX: usize = 16 << 10;

/// Bytes one bundle holds at most (also bounded by the peer's largest
/// message): a bundle is acknowledged as a whole, so a large one holds its
/// first message's completion back.
pub const BUNDLE_MAX: usize = 64 << 10;

/// Length prefix of each message in a bundle.
const PREFIX: usize = 4;

/// What to post for a run of messages, in order.
#[derive(Debug, PartialEq, Eq)]
pub enum Post {
    /// One message, as a plain SEND.
    Single(Bytes),
    /// Several messages in one SEND with [`BUNDLE_IMM`].
    Bundle {
        /// The bundle's payload.
        payload: Bytes,
        /// Messages in it.
        parts: usize,
    },
}

/// Group `msgs` into bundles of consecutive small messages, each at most
/// `limit` bytes long (the peer's largest message, and [`BUNDLE_MAX`]);
/// the rest go alone. Order is kept; a group of one goes alone.
pub fn plan(msgs: Vec<Bytes>, limit: usize) -> Vec<Post> {
    let limit = limit.min(BUNDLE_MAX);
    let mut out = Vec::new();
    let mut group: Vec<Bytes> = Vec::new();
    let mut group_len = 0;
    let close = |group: &mut Vec<Bytes>, group_len: &mut usize, out: &mut Vec<Post>| {
        match group.len() {
            0 => {}
            1 => out.push(Post::Single(group.pop().expect("one"))),
            n => {
                let mut b = BytesMut::with_capacity(*group_len);
                for m in group.drain(..) {
                    b.put_u32_le(m.len() as u32);
                    b.put_slice(&m);
                }
                out.push(Post::Bundle {
                    payload: b.freeze(),
                    parts: n,
                });
            }
        }
        *group_len = 0;
    };
    for m in msgs {
        let need = PREFIX + m.len();
        if m.len() >= PART_MAX || need > limit {
            close(&mut group, &mut group_len, &mut out);
            out.push(Post::Single(m));
            continue;
        }
        if group_len + need > limit {
            close(&mut group, &mut group_len, &mut out);
        }
        group_len += need;
        group.push(m);
    }
    close(&mut group, &mut group_len, &mut out);
    out
}

/// The messages of a received bundle, in order (slices of `payload`, no
/// copies), or why it is malformed (longer than [`BUNDLE_MAX`], a length
/// past its end, or no message). The bound keeps what a peer can make us
/// hold per receive small: each message handed out costs more than its
/// 4-byte prefix, so 64 KiB of empty messages are about 1 MiB of entries,
/// where a bundle as large as the largest message would be hundreds.
pub fn split(payload: &Bytes) -> Result<Vec<Bytes>, String> {
    if payload.len() > BUNDLE_MAX {
        return Err(format!(
            "a bundle of {} bytes (at most {BUNDLE_MAX})",
            payload.len()
        ));
    }
    let mut parts = Vec::new();
    let mut at = 0;
    while at < payload.len() {
        let Some(prefix) = payload.get(at..at + PREFIX) else {
            return Err(format!(
                "a bundle of {} bytes ends inside a length prefix at byte {at}",
                payload.len()
            ));
        };
        let len = u32::from_le_bytes(prefix.try_into().expect("4 bytes")) as usize;
        let start = at + PREFIX;
        if len > payload.len() - start {
            return Err(format!(
                "a bundle of {} bytes names a message of {len} bytes at byte {at}",
                payload.len()
            ));
        }
        parts.push(payload.slice(start..start + len));
        at = start + len;
    }
    if parts.is_empty() {
        return Err("an empty bundle".into());
    }
    Ok(parts)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn msg(n: usize, seed: u8) -> Bytes {
        (0..n)
            .map(|i| (i as u8).wrapping_mul(31) ^ seed)
            .collect::<Vec<u8>>()
            .into()
    }

    fn unplan(posts: &[Post]) -> Vec<Bytes> {
        let mut out = Vec::new();
        for p in posts {
            match p {
                Post::Single(m) => out.push(m.clone()),
                Post::Bundle { payload, parts } => {
                    let got = split(payload).expect("well-formed");
                    assert_eq!(got.len(), *parts);
                    out.extend(got);
                }
            }
        }
        out
    }

    #[test]
    fn small_messages_share_a_bundle_and_large_ones_go_alone_in_order() {
        let msgs = vec![
            msg(4096, 1),
            msg(4096, 2),
            msg(PART_MAX, 3),
            msg(0, 4),
            msg(10, 5),
            msg(1, 6),
        ];
        let posts = plan(msgs.clone(), 16 << 20);
        assert_eq!(posts.len(), 3);
        match &posts[0] {
            Post::Bundle { payload, parts } => {
                assert_eq!(*parts, 2);
                assert_eq!(payload.len(), 2 * (4 + 4096));
                assert_eq!(&payload[..4], &4096u32.to_le_bytes());
            }
            p => panic!("expected a bundle, got {p:?}"),
        }
        assert_eq!(posts[1], Post::Single(msgs[2].clone()));
        assert!(matches!(posts[2], Post::Bundle { parts: 3, .. }));
        assert_eq!(unplan(&posts), msgs);
    }

    #[test]
    fn bundles_respect_the_peers_limit_and_a_lone_message_is_not_bundled() {
        // 100-byte messages (104 with their prefix) under a 1000-byte limit:
        // nine per bundle.
        let msgs: Vec<Bytes> = (0..20).map(|i| msg(100, i)).collect();
        let posts = plan(msgs.clone(), 1000);
        let sizes: Vec<usize> = posts
            .iter()
            .map(|p| match p {
                Post::Bundle { payload, parts } => {
                    assert!(payload.len() <= 1000);
                    *parts
                }
                Post::Single(_) => 1,
            })
            .collect();
        assert_eq!(sizes, vec![9, 9, 2]);
        assert_eq!(unplan(&posts), msgs);
        let one = plan(vec![msg(8, 9)], 1000);
        assert_eq!(one, vec![Post::Single(msg(8, 9))]);
        // A message that cannot fit the limit with its prefix goes alone.
        let big = plan(vec![msg(8, 1), msg(997, 2), msg(8, 3)], 1000);
        assert_eq!(big.len(), 3);
        assert!(big.iter().all(|p| matches!(p, Post::Single(_))));
    }

    #[test]
    fn malformed_bundles_are_refused_with_the_reason() {
        let e = split(&Bytes::new()).unwrap_err();
        assert!(e.contains("empty"), "{e}");
        let e = split(&Bytes::from_static(&[5, 0, 0])).unwrap_err();
        assert!(e.contains("inside a length prefix"), "{e}");
        let e = split(&Bytes::from_static(&[5, 0, 0, 0, 1, 2])).unwrap_err();
        assert!(e.contains("names a message of 5 bytes"), "{e}");
        let e = split(&Bytes::from_static(&[0xff, 0xff, 0xff, 0xff])).unwrap_err();
        assert!(e.contains("4294967295"), "{e}");
        let huge = Bytes::from(vec![0u8; BUNDLE_MAX + 4]);
        let e = split(&huge).unwrap_err();
        assert!(e.contains("at most 65536"), "{e}");
        let most = split(&Bytes::from(vec![0u8; BUNDLE_MAX])).unwrap();
        assert_eq!(most.len(), BUNDLE_MAX / 4, "empty messages up to the bound");
        // Two well-formed empty messages are fine.
        let ok = split(&Bytes::from_static(&[0, 0, 0, 0, 0, 0, 0, 0])).unwrap();
        assert_eq!(ok, vec![Bytes::new(), Bytes::new()]);
    }

    proptest! {
        /// Any run of messages comes back whole and in order, every bundle
        /// within the limit.
        #[test]
        fn plan_then_split_gives_the_messages_back(
            sizes in proptest::collection::vec(0usize..20_000, 0..40),
            limit in 64usize..200_000,
        ) {
            let msgs: Vec<Bytes> = sizes.iter().enumerate().map(|(i, &n)| msg(n, i as u8)).collect();
            let posts = plan(msgs.clone(), limit);
            for p in &posts {
                if let Post::Bundle { payload, parts } = p {
                    prop_assert!(payload.len() <= limit.min(BUNDLE_MAX));
                    prop_assert!(*parts >= 2);
                }
            }
            prop_assert_eq!(unplan(&posts), msgs);
        }

        /// Arbitrary bytes never panic the splitter, and what it accepts
        /// accounts for every byte.
        #[test]
        fn split_takes_any_bytes_without_panicking(data in proptest::collection::vec(any::<u8>(), 0..300)) {
            let payload = Bytes::from(data);
            if let Ok(parts) = split(&payload) {
                let total: usize = parts.iter().map(|p| p.len() + PREFIX).sum();
                prop_assert_eq!(total, payload.len());
            }
        }
    }
}
