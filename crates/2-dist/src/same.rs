//! The check that every rank of a group runs the same model, made once when the group forms.
//!
//! Ranks whose models differ (4 classes on one, 5 on another; other routes, batch or image
//! size) would otherwise train together: the gradient all-reduce only sees buffer lengths, and
//! equal lengths from different models sum into nonsense. Each rank describes its model by a
//! [`Fingerprint`]: a 64-bit hash of everything that must agree and a short summary for
//! people. The fingerprints are all-gathered through the group's own collective (one
//! all-reduce of a `u32` buffer in which each rank fills only its own slot, so the sum is
//! every rank's words, exactly), and every rank compares all of them: each rank reaches the
//! same verdict, so a mismatch fails every rank with [`DistError::ModelMismatch`] and none
//! waits for another.

use super::{Collective, DistError, ReduceOp};

/// The most bytes of a summary that are exchanged (longer ones are cut at a character).
pub const SUMMARY_BYTES: usize = 160;

/// Words of one rank's slot: the hash (two words), the summary's length, its bytes.
const SLOT_WORDS: usize = 3 + SUMMARY_BYTES / 4;

/// What a rank says about its model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fingerprint {
    /// A hash of everything that must agree across ranks.
    pub hash: u64,
    /// For people: e.g. `resnet18 classes 4 batch 8 hw 32 routes f*20`.
    pub summary: String,
}

impl Fingerprint {
    /// The fingerprint of a canonical description `full` (hashed with FNV-1a, the same on
    /// every platform and process) with a `summary` for messages.
    pub fn of(full: &str, summary: impl Into<String>) -> Self {
        let mut hash = 0xcbf2_9ce4_8422_2325u64;
        for b in full.bytes() {
            hash ^= u64::from(b);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
        Fingerprint {
            hash,
            summary: summary.into(),
        }
    }

    /// The group's buffer with this rank's slot filled and every other slot zero.
    pub fn words(&self, rank: usize, world: usize) -> Vec<u32> {
        let mut out = vec![0u32; SLOT_WORDS * world];
        if rank >= world {
            return out;
        }
        let mut end = self.summary.len().min(SUMMARY_BYTES);
        while !self.summary.is_char_boundary(end) {
            end -= 1;
        }
        let bytes = &self.summary.as_bytes()[..end];
        let slot = &mut out[rank * SLOT_WORDS..(rank + 1) * SLOT_WORDS];
        slot[0] = self.hash as u32;
        slot[1] = (self.hash >> 32) as u32;
        slot[2] = end as u32;
        for (w, chunk) in slot[3..].iter_mut().zip(bytes.chunks(4)) {
            let mut b = [0u8; 4];
            b[..chunk.len()].copy_from_slice(chunk);
            *w = u32::from_le_bytes(b);
        }
        out
    }

    /// Every rank's fingerprint from the all-reduced buffer of [`Fingerprint::words`].
    fn from_slot(slot: &[u32]) -> Self {
        let hash = u64::from(slot[0]) | (u64::from(slot[1]) << 32);
        let bytes: Vec<u8> = slot[3..].iter().flat_map(|w| w.to_le_bytes()).collect();
        let len = (slot[2] as usize).min(bytes.len());
        Fingerprint {
            hash,
            summary: String::from_utf8_lossy(&bytes[..len]).into_owned(),
        }
    }
}

/// The verdict on a gathered buffer (every rank's slot filled), as rank `me` states it: the
/// first rank whose hash differs from rank 0's is named against rank 0 (the same two ranks
/// on every rank).
///
/// # Errors
/// [`DistError::ModelMismatch`]; [`DistError::Mismatch`] for a buffer of the wrong length.
pub fn check_gathered(words: &[u32], me: usize, world: usize) -> Result<(), DistError> {
    if world == 0 || words.len() != SLOT_WORDS * world {
        return Err(DistError::Mismatch {
            seq: 0,
            me,
            mine: format!("{} fingerprint words", SLOT_WORDS * world),
            other: me,
            theirs: format!("{} words", words.len()),
        });
    }
    let all: Vec<Fingerprint> = words
        .chunks_exact(SLOT_WORDS)
        .map(Fingerprint::from_slot)
        .collect();
    let Some(other) = all.iter().position(|f| f.hash != all[0].hash) else {
        return Ok(());
    };
    Err(DistError::ModelMismatch {
        me,
        rank_a: 0,
        hash_a: all[0].hash,
        summary_a: all[0].summary.clone(),
        rank_b: other,
        hash_b: all[other].hash,
        summary_b: all[other].summary.clone(),
    })
}

/// Checks, through `comm`, that every rank of its group gave the same fingerprint. Every
/// rank must call it, at the same point (it is one collective).
///
/// # Errors
/// [`DistError::ModelMismatch`] on every rank when any two differ; the collective's errors.
pub fn check_same_model<C: Collective<[u32]> + ?Sized>(
    comm: &mut C,
    mine: &Fingerprint,
) -> Result<(), DistError> {
    let (me, world) = (comm.rank(), comm.world());
    let mut words = mine.words(me, world);
    comm.all_reduce(&mut words[..], ReduceOp::Sum)?;
    check_gathered(&words, me, world)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::CpuGroup;

    #[test]
    fn equal_models_pass_and_different_ones_fail_every_rank() {
        let run = |summaries: [&'static str; 3]| {
            let comms = CpuGroup::ranks(3).unwrap();
            std::thread::scope(|s| {
                let handles: Vec<_> = comms
                    .into_iter()
                    .zip(summaries)
                    .map(|(mut c, sum)| {
                        s.spawn(move || check_same_model(&mut c, &Fingerprint::of(sum, sum)))
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().unwrap())
                    .collect::<Vec<_>>()
            })
        };
        assert!(run(["a", "a", "a"]).iter().all(Result::is_ok));
        let out = run(["net classes 4", "net classes 4", "net classes 5"]);
        for (me, r) in out.iter().enumerate() {
            let e = r.clone().unwrap_err();
            assert!(
                matches!(&e, DistError::ModelMismatch { me: m, rank_a: 0, rank_b: 2, .. } if *m == me),
                "{e:?}"
            );
            let text = e.to_string();
            assert!(
                text.contains("net classes 4") && text.contains("net classes 5"),
                "{text}"
            );
        }
    }

    #[test]
    fn summaries_survive_the_words_and_long_ones_are_cut_at_a_character() {
        let f = Fingerprint::of("x", "é".repeat(100));
        let words = f.words(1, 2);
        assert!(words[..SLOT_WORDS].iter().all(|&w| w == 0));
        let back = Fingerprint::from_slot(&words[SLOT_WORDS..]);
        assert_eq!(back.hash, f.hash);
        assert_eq!(back.summary, "é".repeat(SUMMARY_BYTES / 2));
        assert_ne!(Fingerprint::of("a", "").hash, Fingerprint::of("b", "").hash);
    }
}
