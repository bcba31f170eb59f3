//! The one-sided GET's check on arbitrary bytes, as a bad node's memory
//! could hold them: an index entry and an item never panic the client; an
//! item it accepts is exactly what encoding its header, key and value
//! gives; and an item encoded from the input verifies, value intact.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rdmx_kv::layout::{encode_item, verify_item, Entry, Header, HEADER};

fuzz_target!(|data: &[u8]| {
    if data.len() < 25 {
        return;
    }
    let (head, rest) = data.split_at(24);
    let entry = Entry::decode(&head[..16]).unwrap_or_default();
    let seed = u64::from_le_bytes(head[16..24].try_into().unwrap());
    let key_len = usize::from(rest[0]).min(rest.len() - 1);
    let (key, item) = rest[1..].split_at(key_len);
    if let Ok((h, vr)) = verify_item(item, &entry, key, seed) {
        let mut again = vec![0u8; h.item_len()];
        encode_item(&mut again, &h, key, &item[vr], seed);
        assert_eq!(again, item);
    }
    // The same bytes as the value of a genuine item of that key.
    let h = Header {
        key_len: key.len() as u16,
        value_len: item.len() as u32,
        flags: entry.tag,
        version: u64::from(entry.version),
        expiry_ms: entry.offset,
    };
    let mut genuine = vec![0u8; h.item_len()];
    encode_item(&mut genuine, &h, key, item, seed);
    let (got, vr) = verify_item(&genuine, &entry, key, seed).expect("a genuine item verifies");
    assert_eq!(got, h);
    assert_eq!(&genuine[vr], item);
    assert_eq!(genuine.len(), HEADER + key.len() + item.len());
});
