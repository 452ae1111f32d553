//! Stored records are read back from a store that anyone with access can write to: decoding
//! arbitrary bytes must never panic or allocate without bound.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = tower_idempotency::internals::decode_record(data);
});
