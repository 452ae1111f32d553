//! The entries of the in-memory store: a slab of entries, found by key through a hash table
//! of `(hash, slot)` pairs, and named by their slot everywhere else (the expiry and eviction
//! indexes), so that an eviction or a sweep reaches its entry without hashing or comparing a
//! key.
//!
//! The table's elements are 16 bytes and carry their hash: rehashing it (in place, once
//! deletions have left it full of tombstones, or growing) moves 16 bytes per entry and reads no
//! key. The map it replaces moved each ~380-byte entry and re-read each key, under the store's
//! lock: every request of the process waited out tens of milliseconds when a store of 100,000
//! entries first filled up. The table is sized for twice the store's bound when it is made (up
//! to [`PRESIZED`] entries), so that a full store's tombstones are cleared in place rather than
//! by doubling it, and written once then (see [`prefault`]): its memory (16 bytes per entry of
//! twice the bound, rounded up to a power of two: 4 MiB for the default 100,000 entries) is
//! taken when the store is made. The slab grows by chunks of [`CHUNK`] slots, allocated as they
//! are needed: an entry never moves, and the slab takes memory for the entries the store holds.

use foldhash::fast::RandomState;
use hashbrown::HashTable;
use std::hash::BuildHasher;

use super::Entry;

/// Entries the table is sized for when the store is made (at most).
const PRESIZED: usize = 1 << 19;

/// Slots per chunk of the slab.
const CHUNK: usize = 1024;

/// Entries by key, each in a slot that stays its own until it is removed.
#[derive(Debug)]
pub(super) struct Entries {
    /// `(hash of the key, slot)` for every entry.
    table: HashTable<(u64, usize)>,
    /// The slab: slot `s` is `chunks[s / CHUNK][s % CHUNK]`.
    chunks: Vec<Box<[Option<Entry>]>>,
    /// Slots handed out so far (each is in use or in `free`).
    used: usize,
    /// Slots of removed entries, taken again first.
    free: Vec<usize>,
    /// foldhash is randomly seeded (so keys cannot be chosen to collide) and hashes these keys
    /// several times faster than SipHash.
    hasher: RandomState,
}

/// Writes `table`'s buckets once (up to its capacity: 7 in 8 of them, on every page), so that
/// the kernel maps its pages when the store is made, not on the requests that first write to
/// each: a new key lands in a bucket at random,
/// and until most of the table had been written (a thousand keys or so for the default bound's
/// 4 MiB), a request's insert took a page fault (about 16 µs of a request that follows an idle
/// pause, docs/BENCHMARKS.md, "Streaming responses"). Fills it with placeholders, one per bucket up to its
/// capacity (consecutive multiples of an odd constant: distinct in the bits that pick the
/// bucket), then clears it, which keeps the allocation.
fn prefault(table: &mut HashTable<(u64, usize)>) {
    const SPREAD: u64 = 0x9E37_79B9_7F4A_7C15;
    for i in 0..table.capacity() as u64 {
        let hash = i.wrapping_mul(SPREAD);
        table.insert_unique(hash, (hash, 0), |&(h, _)| h);
    }
    table.clear();
}

impl Entries {
    /// A table for twice `bound` entries (up to [`PRESIZED`]), its memory written once now (see
    /// [`prefault`]).
    pub(super) fn with_bound(bound: usize) -> Self {
        let mut table = HashTable::with_capacity(bound.saturating_mul(2).min(PRESIZED));
        prefault(&mut table);
        Entries {
            table,
            chunks: Vec::new(),
            used: 0,
            free: Vec::new(),
            hasher: RandomState::default(),
        }
    }

    fn slot(&self, slot: usize) -> Option<&Entry> {
        self.chunks.get(slot / CHUNK)?[slot % CHUNK].as_ref()
    }

    /// Slot `slot`, if the slab has it.
    fn place_mut(&mut self, slot: usize) -> Option<&mut Option<Entry>> {
        Some(&mut self.chunks.get_mut(slot / CHUNK)?[slot % CHUNK])
    }

    fn hash(&self, key: &str) -> u64 {
        self.hasher.hash_one(key)
    }

    /// The slot of the entry under `key`.
    pub(super) fn find(&self, key: &str) -> Option<usize> {
        let hash = self.hash(key);
        self.table
            .find(hash, |&(h, slot)| {
                h == hash && self.slot(slot).is_some_and(|e| &*e.key == key)
            })
            .map(|&(_, slot)| slot)
    }

    /// The entry in `slot`, which must hold one.
    pub(super) fn get(&self, slot: usize) -> &Entry {
        match self.slot(slot) {
            Some(entry) => entry,
            None => unreachable!("slot {slot} holds no entry"),
        }
    }

    /// The entry in `slot`, which must hold one.
    pub(super) fn get_mut(&mut self, slot: usize) -> &mut Entry {
        match self.place_mut(slot) {
            Some(Some(entry)) => entry,
            _ => unreachable!("slot {slot} holds no entry"),
        }
    }

    /// Adds a new, empty entry under `key` (which holds none): its slot.
    pub(super) fn insert(&mut self, key: &str) -> usize {
        let hash = self.hash(key);
        let slot = self.free.pop().unwrap_or_else(|| {
            if self.used == self.chunks.len() * CHUNK {
                self.chunks.push((0..CHUNK).map(|_| None).collect());
            }
            self.used += 1;
            self.used - 1
        });
        // Handed out above: its chunk exists.
        let place = &mut self.chunks[slot / CHUNK][slot % CHUNK];
        debug_assert!(place.is_none(), "slot {slot} handed out while in use");
        *place = Some(Entry::new(key.into(), hash));
        self.table.insert_unique(hash, (hash, slot), |&(h, _)| h);
        slot
    }

    /// Removes the entry in `slot`.
    pub(super) fn remove(&mut self, slot: usize) {
        let Some(entry) = self.place_mut(slot).and_then(Option::take) else {
            return;
        };
        if let Ok(found) = self.table.find_entry(entry.hash, |&(_, s)| s == slot) {
            found.remove();
        }
        self.free.push(slot);
    }

    /// Every entry, with its slot.
    pub(super) fn iter(&self) -> impl Iterator<Item = (usize, &Entry)> {
        self.chunks
            .iter()
            .flat_map(|c| c.iter())
            .enumerate()
            .filter_map(|(slot, e)| e.as_ref().map(|e| (slot, e)))
    }

    /// What does not hold: every entry found by its key in its slot, the table holding those
    /// and no more, every free slot empty and listed once, every slot in use or free (for
    /// tests).
    #[cfg(test)]
    pub(super) fn audit(&self) -> Vec<String> {
        let mut problems = Vec::new();
        let mut entries = 0;
        for (slot, entry) in self.iter() {
            entries += 1;
            if self.find(&entry.key) != Some(slot) {
                problems.push(format!(
                    "{}: not found by its key in slot {slot}",
                    entry.key
                ));
            }
        }
        if self.len() != entries {
            problems.push(format!(
                "{} entries found by key, {entries} in their slots",
                self.len()
            ));
        }
        let mut seen = std::collections::HashSet::new();
        for &slot in &self.free {
            if !seen.insert(slot) {
                problems.push(format!("slot {slot} is free twice"));
            }
            if slot >= self.used || self.slot(slot).is_some() {
                problems.push(format!("free slot {slot} is not an empty slot handed out"));
            }
        }
        if self.len() + self.free.len() != self.used {
            problems.push(format!(
                "{} entries and {} free slots, {} handed out",
                self.len(),
                self.free.len(),
                self.used
            ));
        }
        problems
    }

    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.table.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Entries are found by key and keep their slot; a removed entry's slot serves the next
    /// one; and churn on a full table (every removal may leave a tombstone) never reallocates
    /// it: its tombstones are cleared in place, moving 16-byte elements, not by doubling it.
    #[test]
    fn slots_are_stable_reused_and_the_table_never_doubles() {
        let bound = 3_000;
        let mut entries = Entries::with_bound(bound);
        let allocated = entries.table.allocation_size();
        let slots: Vec<usize> = (0..bound)
            .map(|i| entries.insert(&format!("k{i}")))
            .collect();
        assert_eq!(entries.len(), bound);
        for (i, slot) in slots.iter().enumerate() {
            assert_eq!(entries.find(&format!("k{i}")), Some(*slot));
            assert_eq!(&*entries.get(*slot).key, format!("k{i}"));
        }
        // Churn at the bound: one out, one new in, a hundred times the bound.
        for next in bound..101 * bound {
            let old = format!("k{}", next - bound);
            let slot = entries.find(&old).expect("present");
            entries.remove(slot);
            assert_eq!(entries.find(&old), None);
            let new = format!("k{next}");
            let taken = entries.insert(&new);
            assert_eq!(taken, slot, "{new}: the freed slot is taken again");
            assert_eq!(entries.find(&new), Some(taken));
        }
        assert_eq!(entries.len(), bound);
        assert_eq!(
            entries.table.allocation_size(),
            allocated,
            "the table never reallocated"
        );
        assert_eq!(
            entries.chunks.len(),
            bound.div_ceil(CHUNK),
            "no slot beyond the bound"
        );
        assert_eq!(entries.iter().count(), bound);
        assert_eq!(entries.audit(), Vec::<String>::new());
        entries.remove(slots[0]);
        entries.remove(slots[0]);
        assert_eq!(
            entries.audit(),
            Vec::<String>::new(),
            "a second removal is a no-op"
        );
    }
}
