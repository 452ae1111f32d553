//! The entries of the in-memory store: a slab of entries, found by key through a hash table
//! of `(hash, slot)` pairs, and named by their slot everywhere else (the expiry and eviction
//! indexes), so that an eviction or a sweep reaches its entry without hashing or comparing a
//! key.
//!
//! The table's elements are 16 bytes and carry their hash: growing it, or rehashing it in place
//! once deletions have left it full of tombstones, moves 16 bytes per entry and reads no key
//! (the map it replaces moved each ~380-byte entry and re-read each key, under the store's
//! lock: every request of the process waited out tens of milliseconds when a store of 100,000
//! entries first filled up). Both the table and the slab are sized for the store's bound when
//! it is made (up to [`PRESIZED`] entries); memory the entries do not use is only reserved,
//! not touched.

use foldhash::fast::RandomState;
use hashbrown::HashTable;
use std::hash::BuildHasher;

use super::Entry;

/// Entries the table and the slab are sized for when the store is made (at most): neither
/// grows before it holds that many.
const PRESIZED: usize = 1 << 18;

/// Entries by key, each in a slot that stays its own until it is removed.
#[derive(Debug)]
pub(super) struct Entries {
    /// `(hash of the key, slot)` for every entry.
    table: HashTable<(u64, usize)>,
    slots: Vec<Option<Entry>>,
    /// Slots of removed entries, taken again first.
    free: Vec<usize>,
    /// foldhash is randomly seeded (so keys cannot be chosen to collide) and hashes these keys
    /// several times faster than SipHash.
    hasher: RandomState,
}

impl Entries {
    /// Room for `bound` entries (up to [`PRESIZED`]) before anything grows.
    pub(super) fn with_bound(bound: usize) -> Self {
        let room = bound.min(PRESIZED);
        Entries {
            table: HashTable::with_capacity(room),
            slots: Vec::with_capacity(room),
            free: Vec::new(),
            hasher: RandomState::default(),
        }
    }

    fn hash(&self, key: &str) -> u64 {
        self.hasher.hash_one(key)
    }

    /// The slot of the entry under `key`.
    pub(super) fn find(&self, key: &str) -> Option<usize> {
        let hash = self.hash(key);
        self.table
            .find(hash, |&(h, slot)| {
                h == hash && self.slots[slot].as_ref().is_some_and(|e| &*e.key == key)
            })
            .map(|&(_, slot)| slot)
    }

    /// The entry in `slot`, which must hold one.
    pub(super) fn get(&self, slot: usize) -> &Entry {
        match self.slots.get(slot) {
            Some(Some(entry)) => entry,
            _ => unreachable!("slot {slot} holds no entry"),
        }
    }

    /// The entry in `slot`, which must hold one.
    pub(super) fn get_mut(&mut self, slot: usize) -> &mut Entry {
        match self.slots.get_mut(slot) {
            Some(Some(entry)) => entry,
            _ => unreachable!("slot {slot} holds no entry"),
        }
    }

    /// Adds a new, empty entry under `key` (which holds none): its slot.
    pub(super) fn insert(&mut self, key: &str) -> usize {
        let hash = self.hash(key);
        let entry = Some(Entry::new(key.into(), hash));
        let slot = match self.free.pop() {
            Some(slot) => {
                self.slots[slot] = entry;
                slot
            }
            None => {
                self.slots.push(entry);
                self.slots.len() - 1
            }
        };
        self.table.insert_unique(hash, (hash, slot), |&(h, _)| h);
        slot
    }

    /// Removes the entry in `slot`.
    pub(super) fn remove(&mut self, slot: usize) {
        let Some(entry) = self.slots.get_mut(slot).and_then(Option::take) else {
            return;
        };
        if let Ok(found) = self.table.find_entry(entry.hash, |&(_, s)| s == slot) {
            found.remove();
        }
        self.free.push(slot);
    }

    /// Every entry, with its slot.
    #[cfg(test)]
    pub(super) fn iter(&self) -> impl Iterator<Item = (usize, &Entry)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(slot, e)| e.as_ref().map(|e| (slot, e)))
    }

    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.table.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Entries are found by key, keep their slot, and a removed entry's slot serves the next
    /// one; the table's capacity set when the store is made is not outgrown below its bound.
    #[test]
    fn slots_are_stable_and_reused() {
        let mut entries = Entries::with_bound(1_000);
        let capacity = entries.table.capacity();
        assert!(capacity >= 1_000, "{capacity}");
        let slots: Vec<usize> = (0..1_000)
            .map(|i| entries.insert(&format!("k{i}")))
            .collect();
        assert_eq!(entries.len(), 1_000);
        for (i, slot) in slots.iter().enumerate() {
            assert_eq!(entries.find(&format!("k{i}")), Some(*slot));
            assert_eq!(&*entries.get(*slot).key, format!("k{i}"));
        }
        // Churn: remove and add many times the bound; nothing outgrows the capacity.
        for round in 0..20 {
            for i in (0..1_000).step_by(3) {
                let key = format!("k{i}");
                if let Some(slot) = entries.find(&key) {
                    entries.remove(slot);
                    assert_eq!(entries.find(&key), None);
                } else {
                    let slot = entries.insert(&key);
                    assert_eq!(entries.find(&key), Some(slot));
                }
            }
            assert!(entries.len() <= 1_000, "round {round}");
        }
        assert_eq!(entries.slots.capacity(), 1_000, "the slab never grew");
        assert_eq!(entries.iter().count(), entries.len());
        let removed = slots[1];
        entries.remove(removed);
        assert_eq!(
            entries.insert("new"),
            removed,
            "a freed slot is taken again"
        );
    }
}
