//! Byte-level mutation of valid inputs, shared by the property tests of the parsers: most bugs
//! of a lenient parser live one byte away from a valid input.

use proptest::prelude::*;
use proptest::sample::Index;

/// A byte edit: (insert, delete or replace; where; which byte).
pub type Edit = (u8, Index, u8);

pub fn edits() -> impl Strategy<Value = Vec<Edit>> {
    let byte = prop_oneof![3 => proptest::sample::select(b"\"\\;,=:?()*- \t\n0aZ.#[]".to_vec()), 1 => any::<u8>()];
    proptest::collection::vec((0..3u8, any::<Index>(), byte), 1..4)
}

pub fn mutated(text: &[u8], edits: &[Edit]) -> Vec<u8> {
    let mut bytes = text.to_vec();
    for &(what, at, byte) in edits {
        match what {
            0 => bytes.insert(at.index(bytes.len() + 1), byte),
            _ if bytes.is_empty() => {}
            1 => {
                bytes.remove(at.index(bytes.len()));
            }
            _ => {
                let i = at.index(bytes.len());
                bytes[i] = byte;
            }
        }
    }
    bytes
}
