//! The operations a connection has posted and not yet seen complete, by
//! work request id.
//!
//! Ids are handed out in increasing order and a reliable connection's send
//! queue completes its work requests in the order they were posted (the
//! verbs' ordering rule for RC; the soft engine's completer pops its queue
//! front first), so the set is a queue: an insert goes at the back and a
//! completion almost always takes the front. A `BTreeMap` paid an
//! allocation-prone node update per operation for an order it never needed
//! to search (2.7% of a soft-RoCE cache gateway's CPU at 16 pipelined GETs,
//! summed over its insert and remove functions).

use std::collections::VecDeque;

/// Values by `u64` id, kept in id order.
#[derive(Debug)]
pub(crate) struct ByWrId<T> {
    q: VecDeque<(u64, T)>,
}

impl<T> Default for ByWrId<T> {
    fn default() -> Self {
        ByWrId { q: VecDeque::new() }
    }
}

impl<T> ByWrId<T> {
    /// Where `id` is, if held: the front first (the next completion),
    /// otherwise a binary search.
    fn index(&self, id: u64) -> Option<usize> {
        match self.q.front() {
            Some(&(f, _)) if f == id => Some(0),
            _ => self.q.binary_search_by_key(&id, |(k, _)| *k).ok(),
        }
    }

    /// Hold `v` under `id` (normally above every id held: it goes at the
    /// back; otherwise in its place). An id already held is replaced.
    pub(crate) fn insert(&mut self, id: u64, v: T) {
        match self.q.back() {
            None => self.q.push_back((id, v)),
            Some(&(b, _)) if b < id => self.q.push_back((id, v)),
            _ => match self.q.binary_search_by_key(&id, |(k, _)| *k) {
                Ok(i) => self.q[i].1 = v,
                Err(i) => self.q.insert(i, (id, v)),
            },
        }
    }

    /// The value under `id`.
    pub(crate) fn get(&self, id: &u64) -> Option<&T> {
        self.index(*id).map(|i| &self.q[i].1)
    }

    /// The value under `id`, to change.
    pub(crate) fn get_mut(&mut self, id: &u64) -> Option<&mut T> {
        self.index(*id).map(|i| &mut self.q[i].1)
    }

    /// Take the value under `id` out.
    pub(crate) fn remove(&mut self, id: &u64) -> Option<T> {
        // `VecDeque::remove(0)` is as cheap as `pop_front`.
        let i = self.index(*id)?;
        self.q.remove(i).map(|(_, v)| v)
    }

    /// The ids held, in increasing order.
    pub(crate) fn keys(&self) -> impl Iterator<Item = &u64> {
        self.q.iter().map(|(k, _)| k)
    }

    /// The values, in id order, to change.
    pub(crate) fn values_mut(&mut self) -> impl Iterator<Item = &mut T> {
        self.q.iter_mut().map(|(_, v)| v)
    }

    /// Ids and values in id order, the values to change.
    pub(crate) fn iter_mut(&mut self) -> impl Iterator<Item = (&u64, &mut T)> {
        self.q.iter_mut().map(|(k, v)| (&*k, v))
    }

    /// How many are held.
    pub(crate) fn len(&self) -> usize {
        self.q.len()
    }

    /// Drop them all.
    pub(crate) fn clear(&mut self) {
        self.q.clear();
    }
}

impl<T> IntoIterator for ByWrId<T> {
    type Item = (u64, T);
    type IntoIter = std::collections::vec_deque::IntoIter<(u64, T)>;

    /// Ids and values in id order.
    fn into_iter(self) -> Self::IntoIter {
        self.q.into_iter()
    }
}

#[cfg(test)]
mod tests {
    use super::ByWrId;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    #[derive(Debug, Clone)]
    enum Step {
        Insert(u64, u32),
        Remove(u64),
        Get(u64),
        Change(u64, u32),
    }

    fn step() -> impl Strategy<Value = Step> {
        // Small ids, so that steps hit ids held; inserts mostly above
        // every id so far, as a connection's are, some anywhere.
        prop_oneof![
            (0u64..64, any::<u32>()).prop_map(|(k, v)| Step::Insert(k, v)),
            (0u64..64).prop_map(Step::Remove),
            (0u64..64).prop_map(Step::Get),
            (0u64..64, any::<u32>()).prop_map(|(k, v)| Step::Change(k, v)),
        ]
    }

    proptest! {
        /// Any sequence of inserts, lookups, changes and removals gives
        /// what a `BTreeMap` gives, and both iterate alike.
        #[test]
        fn behaves_as_an_ordered_map(steps in proptest::collection::vec(step(), 0..200)) {
            let mut ours = ByWrId::default();
            let mut model = BTreeMap::new();
            let mut next = 0u64;
            for s in steps {
                match s {
                    Step::Insert(k, v) => {
                        // Every other insert takes the next increasing id.
                        let id = if v % 2 == 0 { next += 1; 64 + next } else { k };
                        ours.insert(id, v);
                        model.insert(id, v);
                    }
                    Step::Remove(k) => prop_assert_eq!(ours.remove(&k), model.remove(&k)),
                    Step::Get(k) => prop_assert_eq!(ours.get(&k), model.get(&k)),
                    Step::Change(k, v) => {
                        if let (Some(a), Some(b)) = (ours.get_mut(&k), model.get_mut(&k)) {
                            *a = v;
                            *b = v;
                        }
                        prop_assert_eq!(ours.get(&k), model.get(&k));
                    }
                }
                prop_assert_eq!(ours.len(), model.len());
            }
            let keys: Vec<u64> = ours.keys().copied().collect();
            prop_assert_eq!(keys, model.keys().copied().collect::<Vec<_>>());
            let all: Vec<(u64, u32)> = ours.into_iter().collect();
            prop_assert_eq!(all, model.into_iter().collect::<Vec<_>>());
        }
    }

    /// Completions in posting order take the front each time.
    #[test]
    fn in_order_completions_empty_it() {
        let mut p = ByWrId::default();
        for id in 0..100u64 {
            p.insert(id, id * 10);
        }
        for v in p.values_mut() {
            *v += 1;
        }
        for id in 0..100u64 {
            assert_eq!(p.get(&id), Some(&(id * 10 + 1)));
            assert_eq!(p.remove(&id), Some(id * 10 + 1));
        }
        assert_eq!(p.len(), 0);
        assert_eq!(p.remove(&5), None);
    }
}
