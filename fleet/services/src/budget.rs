//! Per-invoke budgets (spec §7.4): every counter of one invoke, keyed by its `invoke_id`, exact under concurrent
//! reverse calls. A budget is exhausted exactly at its boundary: the Nth call of a cap of N is admitted, the
//! (N+1)th is refused, however many calls race for the last slot (one mutex, held for a few instructions, never
//! across an `.await`).
//!
//! Counting rules:
//! * sampling: a call is counted when admitted (after request validation, before the upstream); tokens are
//!   counted from the upstream's reported usage when the call settles. A call is admitted while
//!   `calls < max_calls` and `tokens_used < max_tokens_total`; otherwise `-32006` / `-32007`.
//! * storage (`storage/*` and `files/*`): every call counts; the 201st is `-32026`.
//! * uploads: a file counts when it is stored (`inline`, `confirm`; `negotiate` is free); bytes are reserved
//!   before the bytes are written and released if the write fails. A `negotiate`'s link counts its bytes against
//!   the total until its `confirm` turns it into the file, and at most as many links as files wait unconfirmed:
//!   PUT bytes never confirmed are bounded like confirmed ones.
//! * images (`image/generate` and `image/edit` together): a call's `n` is reserved before the provider is asked
//!   and what it did not deliver is given back; past the cap (spec §7.4 `image_token.max_images`, 4) `-32106`. The
//!   count starts again [`limits::IMAGE_INVOKE_WINDOW`] (30 min) after the window's first image, as the spec's
//!   Redis key with its 30-min TTL does.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

use fleet_proto::limits;

/// The caps of one invoke (the token's claims, defaulting to the spec's numbers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BudgetLimits {
    /// Sampling calls per invoke (spec: 8).
    pub sampling_calls: u32,
    /// Sampling tokens per invoke, from reported usage (spec: 32 000).
    pub sampling_tokens: u64,
    /// `storage/*` + `files/*` calls per invoke (spec: 200).
    pub storage_calls: u32,
    /// Files stored by `host/uploadFile` per invoke (spec: 16).
    pub upload_files: u32,
    /// Bytes stored by `host/uploadFile` per invoke (spec: 80 MiB).
    pub upload_total_bytes: u64,
    /// Largest single uploaded file (spec: 20 MiB token default).
    pub upload_file_bytes: u64,
    /// Images per invoke, `image/generate` and `image/edit` together (spec: 4).
    pub images_per_invoke: u32,
}

impl Default for BudgetLimits {
    fn default() -> Self {
        BudgetLimits {
            sampling_calls: limits::SAMPLING_MAX_CALLS_PER_INVOKE,
            sampling_tokens: u64::from(limits::SAMPLING_MAX_TOKENS_PER_INVOKE),
            storage_calls: limits::STORAGE_MAX_CALLS_PER_INVOKE,
            upload_files: limits::UPLOAD_MAX_FILES_PER_INVOKE,
            upload_total_bytes: limits::UPLOAD_MAX_TOTAL_BYTES_PER_INVOKE as u64,
            upload_file_bytes: limits::UPLOAD_MAX_FILE_BYTES as u64,
            images_per_invoke: limits::IMAGE_DEFAULT_MAX_PER_INVOKE,
        }
    }
}

/// Which cap refused a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Exhausted {
    /// `-32006 SAMPLING_MAX_CALLS_EXCEEDED`.
    #[error("the invoke has used all {0} sampling calls")]
    SamplingCalls(u32),
    /// `-32007 SAMPLING_MAX_TOKENS_EXCEEDED`.
    #[error("the invoke has used {used} of its {cap} sampling tokens")]
    SamplingTokens {
        /// Tokens used so far.
        used: u64,
        /// The cap.
        cap: u64,
    },
    /// `-32026 RATE_LIMITED`.
    #[error("the invoke has used all {0} storage calls")]
    StorageCalls(u32),
    /// `-32211 MAX_FILES_EXCEEDED`.
    #[error("the invoke has stored all {0} files it may upload")]
    UploadFiles(u32),
    /// `-32211 MAX_FILES_EXCEEDED`: as many negotiated uploads wait for their `confirm` as the invoke may store
    /// files.
    #[error("the invoke has {0} negotiated uploads not yet confirmed, as many as it may store")]
    UploadOffers(u32),
    /// `-32204 TOO_LARGE`.
    #[error("{bytes} bytes exceed the {cap}-byte limit of one file")]
    UploadFileTooLarge {
        /// The file's size.
        bytes: u64,
        /// The cap.
        cap: u64,
    },
    /// `-32202` with `UPLOAD_MAX_BYTES_EXCEEDED` (spec §16 A-32).
    #[error("{bytes} more bytes would exceed the invoke's {cap}-byte upload total ({used} used)")]
    UploadTotalBytes {
        /// The file's size.
        bytes: u64,
        /// Bytes stored or reserved so far.
        used: u64,
        /// The cap.
        cap: u64,
    },
    /// `-32106 IMAGE_MAX_IMAGES_EXCEEDED` with `data.images` (what the invoke would have had) and
    /// `data.maxImages`.
    #[error("{asked} more images would take the invoke to {images}, over its {cap} (spec §7.4 max_images)")]
    Images {
        /// Images asked for by this call.
        asked: u32,
        /// Images of the invoke had the call been served (reserved so far + `asked`).
        images: u32,
        /// The cap.
        cap: u32,
    },
}

#[derive(Debug, Default)]
struct Counters {
    sampling_calls: u32,
    sampling_tokens: u64,
    storage_calls: u32,
    upload_files: u32,
    upload_bytes: u64,
    /// PUT links `negotiate` handed out and no `confirm` took yet: r2_key → the bytes each allows.
    upload_offers: HashMap<String, u64>,
    /// Images reserved or delivered in the current window.
    images: u32,
    /// When the current image window began (its first reservation), and its number.
    images_window: Option<(Instant, u64)>,
}

impl Counters {
    fn offered_bytes(&self) -> u64 {
        self.upload_offers.values().sum()
    }
}

/// The budget of one invoke.
#[derive(Debug)]
pub struct InvokeBudget {
    limits: BudgetLimits,
    counters: Mutex<Counters>,
    created: Instant,
}

impl InvokeBudget {
    /// A fresh budget.
    pub fn new(limits: BudgetLimits) -> InvokeBudget {
        InvokeBudget {
            limits,
            counters: Mutex::new(Counters::default()),
            created: Instant::now(),
        }
    }

    /// Its caps.
    pub fn limits(&self) -> &BudgetLimits {
        &self.limits
    }

    /// When it was created (for the sweep of budgets whose invoke-end was never reported).
    pub fn created(&self) -> Instant {
        self.created
    }

    fn counters(&self) -> std::sync::MutexGuard<'_, Counters> {
        self.counters
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Admits one sampling call (counts it) or says which cap is exhausted. Returns the tokens left.
    pub fn admit_sampling(&self) -> Result<u64, Exhausted> {
        let mut c = self.counters();
        if c.sampling_calls >= self.limits.sampling_calls {
            return Err(Exhausted::SamplingCalls(self.limits.sampling_calls));
        }
        if c.sampling_tokens >= self.limits.sampling_tokens {
            return Err(Exhausted::SamplingTokens {
                used: c.sampling_tokens,
                cap: self.limits.sampling_tokens,
            });
        }
        c.sampling_calls += 1;
        Ok(self.limits.sampling_tokens - c.sampling_tokens)
    }

    /// Adds the upstream's reported usage of an admitted call.
    pub fn settle_sampling(&self, tokens: u64) {
        let mut c = self.counters();
        c.sampling_tokens = c.sampling_tokens.saturating_add(tokens);
    }

    /// Sampling calls admitted and tokens used so far.
    pub fn sampling_used(&self) -> (u32, u64) {
        let c = self.counters();
        (c.sampling_calls, c.sampling_tokens)
    }

    /// Counts one `storage/*` or `files/*` call, or refuses it.
    pub fn admit_storage(&self) -> Result<(), Exhausted> {
        let mut c = self.counters();
        if c.storage_calls >= self.limits.storage_calls {
            return Err(Exhausted::StorageCalls(self.limits.storage_calls));
        }
        c.storage_calls += 1;
        Ok(())
    }

    /// Storage calls counted so far.
    pub fn storage_used(&self) -> u32 {
        self.counters().storage_calls
    }

    /// Reserves one file of `bytes` against the upload caps (the bytes of unconfirmed negotiated uploads count
    /// too). Dropping the reservation without [`UploadReservation::commit`] gives the file and its bytes back.
    pub fn reserve_upload(&self, bytes: u64) -> Result<UploadReservation<'_>, Exhausted> {
        self.reserve_upload_of(None, bytes)
    }

    /// Lets `negotiate` hand out a PUT link of up to `bytes` under `key`. Free in the files counter (spec §8.7:
    /// a file counts at its `confirm`), but its bytes count against the invoke's upload total from now on, and at
    /// most `upload_files` links wait unconfirmed: what a plugin can store without ever confirming is bounded by
    /// the same caps as what it confirms.
    pub fn offer_upload(&self, key: &str, bytes: u64) -> Result<(), Exhausted> {
        self.check_file_size(bytes)?;
        let mut c = self.counters();
        if c.upload_offers.len() >= self.limits.upload_files as usize {
            return Err(Exhausted::UploadOffers(self.limits.upload_files));
        }
        self.check_total(&c, bytes)?;
        c.upload_offers.insert(key.to_owned(), bytes);
        Ok(())
    }

    /// One file of `bytes` is within the single-file cap.
    fn check_file_size(&self, bytes: u64) -> Result<(), Exhausted> {
        if bytes > self.limits.upload_file_bytes {
            return Err(Exhausted::UploadFileTooLarge {
                bytes,
                cap: self.limits.upload_file_bytes,
            });
        }
        Ok(())
    }

    /// `bytes` more fit the invoke's upload total, counting stored files and unconfirmed offers.
    fn check_total(&self, c: &Counters, bytes: u64) -> Result<(), Exhausted> {
        let used = c.upload_bytes.saturating_add(c.offered_bytes());
        if used.saturating_add(bytes) > self.limits.upload_total_bytes {
            return Err(Exhausted::UploadTotalBytes {
                bytes,
                used,
                cap: self.limits.upload_total_bytes,
            });
        }
        Ok(())
    }

    /// Reserves the file a `confirm` stores under `key` ([`reserve_upload`](Self::reserve_upload)): the link's
    /// offer, if this invoke made it, becomes the file (given back as an offer if the reservation is dropped).
    pub fn reserve_confirmed_upload(
        &self,
        key: &str,
        bytes: u64,
    ) -> Result<UploadReservation<'_>, Exhausted> {
        self.reserve_upload_of(Some(key), bytes)
    }

    fn reserve_upload_of(&self, key: Option<&str>, bytes: u64) -> Result<UploadReservation<'_>, Exhausted> {
        self.check_file_size(bytes)?;
        let mut c = self.counters();
        let offer = key.and_then(|k| c.upload_offers.remove_entry(k));
        let admitted = if c.upload_files >= self.limits.upload_files {
            Err(Exhausted::UploadFiles(self.limits.upload_files))
        } else {
            self.check_total(&c, bytes)
        };
        if let Err(refused) = admitted {
            if let Some((k, v)) = offer {
                c.upload_offers.insert(k, v);
            }
            return Err(refused);
        }
        c.upload_files += 1;
        c.upload_bytes += bytes;
        Ok(UploadReservation {
            budget: self,
            bytes,
            offer,
            committed: false,
        })
    }

    /// Files and bytes stored (or reserved) so far.
    pub fn upload_used(&self) -> (u32, u64) {
        let c = self.counters();
        (c.upload_files, c.upload_bytes)
    }

    /// Negotiated uploads waiting for their `confirm`: how many, and the bytes they allow.
    pub fn uploads_offered(&self) -> (usize, u64) {
        let c = self.counters();
        (c.upload_offers.len(), c.offered_bytes())
    }

    /// Reserves `n` images of the invoke's cap. Dropping the reservation gives them back; [`ImageReservation::
    /// settle`] keeps what was delivered.
    pub fn reserve_images(&self, n: u32) -> Result<ImageReservation<'_>, Exhausted> {
        self.reserve_images_at(n, Instant::now())
    }

    /// [`Self::reserve_images`] as of `now` (the window's clock).
    fn reserve_images_at(&self, n: u32, now: Instant) -> Result<ImageReservation<'_>, Exhausted> {
        let cap = self.limits.images_per_invoke;
        let mut c = self.counters();
        let current = c.images_window;
        let window = match current {
            Some((start, number)) if now.duration_since(start) < limits::IMAGE_INVOKE_WINDOW => number,
            previous => {
                // The first image of the invoke, or the window passed: the count starts again.
                let number = previous.map_or(0, |(_, number)| number + 1);
                c.images = 0;
                c.images_window = Some((now, number));
                number
            }
        };
        let images = c.images.saturating_add(n);
        if images > cap {
            return Err(Exhausted::Images {
                asked: n,
                images,
                cap,
            });
        }
        c.images = images;
        Ok(ImageReservation {
            budget: self,
            window,
            reserved: n,
            delivered: 0,
        })
    }

    /// Images reserved or delivered in the current window.
    pub fn images_used(&self) -> u32 {
        self.counters().images
    }
}

/// Images reserved for one `image/*` call; see [`InvokeBudget::reserve_images`].
#[derive(Debug)]
pub struct ImageReservation<'a> {
    budget: &'a InvokeBudget,
    /// The window it was counted in (a refund never reaches into a later window).
    window: u64,
    reserved: u32,
    delivered: u32,
}

impl ImageReservation<'_> {
    /// `delivered` of the reserved images reached the plugin: keep them, give the rest back.
    pub fn settle(mut self, delivered: u32) {
        self.delivered = delivered.min(self.reserved);
    }
}

impl Drop for ImageReservation<'_> {
    fn drop(&mut self) {
        let give_back = self.reserved - self.delivered;
        if give_back == 0 {
            return;
        }
        let mut c = self.budget.counters();
        if c.images_window.is_some_and(|(_, number)| number == self.window) {
            c.images = c.images.saturating_sub(give_back);
        }
    }
}

/// A reserved upload slot; see [`InvokeBudget::reserve_upload`].
#[derive(Debug)]
pub struct UploadReservation<'a> {
    budget: &'a InvokeBudget,
    bytes: u64,
    /// The negotiated offer the file was confirmed from, given back if it is not stored.
    offer: Option<(String, u64)>,
    committed: bool,
}

impl UploadReservation<'_> {
    /// The file was stored: keep the slot and the bytes.
    pub fn commit(mut self) {
        self.committed = true;
    }
}

impl Drop for UploadReservation<'_> {
    fn drop(&mut self) {
        if !self.committed {
            let mut c = self.budget.counters();
            c.upload_files = c.upload_files.saturating_sub(1);
            c.upload_bytes = c.upload_bytes.saturating_sub(self.bytes);
            if let Some((key, bytes)) = self.offer.take() {
                c.upload_offers.insert(key, bytes);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[test]
    fn sampling_calls_stop_exactly_at_the_cap_under_contention() {
        let budget = Arc::new(InvokeBudget::new(BudgetLimits::default()));
        for _ in 0..7 {
            budget.admit_sampling().expect("admitted");
        }
        let admitted: usize = std::thread::scope(|s| {
            let handles: Vec<_> = (0..8)
                .map(|_| s.spawn(|| budget.admit_sampling().is_ok()))
                .collect();
            handles
                .into_iter()
                .map(|h| usize::from(h.join().expect("thread")))
                .sum()
        });
        assert_eq!(admitted, 1, "exactly one of 8 racers wins the last slot");
        assert_eq!(budget.admit_sampling(), Err(Exhausted::SamplingCalls(8)));
    }

    #[test]
    fn sampling_tokens_refuse_once_the_reported_usage_reaches_the_cap() {
        let budget = InvokeBudget::new(BudgetLimits::default());
        assert_eq!(budget.admit_sampling(), Ok(32_000));
        budget.settle_sampling(31_999);
        assert_eq!(budget.admit_sampling(), Ok(1), "31 999 used: one token left");
        budget.settle_sampling(1);
        assert_eq!(
            budget.admit_sampling(),
            Err(Exhausted::SamplingTokens {
                used: 32_000,
                cap: 32_000
            })
        );
    }

    #[test]
    fn storage_calls_admit_200_and_refuse_the_201st() {
        let budget = InvokeBudget::new(BudgetLimits::default());
        for _ in 0..200 {
            budget.admit_storage().expect("admitted");
        }
        assert_eq!(budget.admit_storage(), Err(Exhausted::StorageCalls(200)));
        assert_eq!(budget.storage_used(), 200);
    }

    #[test]
    fn uploads_count_files_and_bytes_and_give_back_a_failed_write() {
        let budget = InvokeBudget::new(BudgetLimits::default());
        let mib = 1024 * 1024;
        assert!(matches!(
            budget.reserve_upload(20 * mib + 1),
            Err(Exhausted::UploadFileTooLarge { .. })
        ));
        budget.reserve_upload(20 * mib).expect("exactly 20 MiB").commit();
        drop(budget.reserve_upload(mib).expect("reserved"));
        assert_eq!(
            budget.upload_used(),
            (1, 20 * mib),
            "dropped reservation given back"
        );
        for _ in 0..3 {
            budget.reserve_upload(20 * mib).expect("fits").commit();
        }
        assert!(matches!(
            budget.reserve_upload(1),
            Err(Exhausted::UploadTotalBytes { used, .. }) if used == 80 * mib
        ));
        let budget = InvokeBudget::new(BudgetLimits::default());
        for _ in 0..16 {
            budget.reserve_upload(1).expect("fits").commit();
        }
        assert_eq!(budget.reserve_upload(1).err(), Some(Exhausted::UploadFiles(16)));
    }

    /// Negotiated links: free in the files counter, but their bytes count until confirmed, and at most as many
    /// links as files wait unconfirmed — a plugin that PUTs and never confirms stores no more than one that
    /// confirms.
    #[test]
    fn negotiated_uploads_hold_their_bytes_until_confirmed() {
        let mib = 1024 * 1024;
        let budget = InvokeBudget::new(BudgetLimits::default());
        for i in 0..4 {
            budget
                .offer_upload(&format!("k{i}"), 20 * mib)
                .expect("80 MiB offered");
        }
        assert_eq!(budget.upload_used(), (0, 0), "no file counted yet");
        assert_eq!(budget.uploads_offered(), (4, 80 * mib));
        assert!(matches!(
            budget.offer_upload("k4", 1),
            Err(Exhausted::UploadTotalBytes { used, .. }) if used == 80 * mib
        ));
        assert!(matches!(
            budget.reserve_upload(1),
            Err(Exhausted::UploadTotalBytes { used, .. }) if used == 80 * mib
        ));
        // A confirm turns its offer into the file (for what was PUT: less than offered frees the rest)...
        budget
            .reserve_confirmed_upload("k0", 5 * mib)
            .expect("its own offer")
            .commit();
        assert_eq!(budget.upload_used(), (1, 5 * mib));
        assert_eq!(budget.uploads_offered(), (3, 60 * mib));
        // ...and a confirm whose write fails gives the offer back.
        drop(
            budget
                .reserve_confirmed_upload("k1", 20 * mib)
                .expect("its own offer"),
        );
        assert_eq!(budget.uploads_offered(), (3, 60 * mib));
        assert_eq!(budget.upload_used(), (1, 5 * mib));
        // A confirm of a key this invoke never negotiated counts like an inline upload (the total is taken).
        budget.offer_upload("k4", 15 * mib).expect("exactly the rest");
        assert!(matches!(
            budget.reserve_confirmed_upload("unknown", 1),
            Err(Exhausted::UploadTotalBytes { .. })
        ));

        // At most as many links as files wait: the 16th is handed out, the 17th refused.
        let budget = InvokeBudget::new(BudgetLimits::default());
        for i in 0..16 {
            budget.offer_upload(&format!("k{i}"), 1).expect("16 links");
        }
        assert_eq!(
            budget.offer_upload("k16", 1).err(),
            Some(Exhausted::UploadOffers(16))
        );
        budget
            .reserve_confirmed_upload("k0", 1)
            .expect("confirmed")
            .commit();
        budget
            .offer_upload("k16", 1)
            .expect("a link freed by its confirm");
    }

    #[test]
    fn images_admit_4_per_invoke_and_give_back_what_was_not_delivered() {
        let budget = InvokeBudget::new(BudgetLimits::default());
        budget.reserve_images(3).expect("3 of 4").settle(3);
        assert_eq!(
            budget.reserve_images(2).err(),
            Some(Exhausted::Images {
                asked: 2,
                images: 5,
                cap: 4
            })
        );
        // A failed call (dropped) and a short one (settled for less) give their images back.
        drop(budget.reserve_images(1).expect("the 4th"));
        assert_eq!(budget.images_used(), 3);
        budget.reserve_images(1).expect("the 4th").settle(0);
        assert_eq!(budget.images_used(), 3);
        budget.reserve_images(1).expect("the 4th").settle(1);
        assert_eq!(budget.images_used(), 4);
        assert!(matches!(
            budget.reserve_images(1),
            Err(Exhausted::Images { images: 5, .. })
        ));
    }

    #[test]
    fn concurrent_image_reservations_never_exceed_the_cap() {
        let budget = Arc::new(InvokeBudget::new(BudgetLimits::default()));
        let admitted: usize = std::thread::scope(|s| {
            let handles: Vec<_> = (0..8)
                .map(|_| {
                    s.spawn(|| match budget.reserve_images(1) {
                        Ok(r) => {
                            r.settle(1);
                            1
                        }
                        Err(_) => 0,
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("thread")).sum()
        });
        assert_eq!(admitted, 4, "exactly 4 of 8 racers get an image");
    }

    #[test]
    fn the_image_count_starts_again_30_minutes_after_its_window_began() {
        let budget = InvokeBudget::new(BudgetLimits::default());
        let t0 = Instant::now();
        // Two images still being produced when the window passes, two delivered.
        let held = budget.reserve_images_at(2, t0).expect("2");
        budget.reserve_images_at(2, t0).expect("2 more").settle(2);
        let just_before = t0 + limits::IMAGE_INVOKE_WINDOW - std::time::Duration::from_millis(1);
        assert!(budget.reserve_images_at(1, just_before).is_err());
        let at = t0 + limits::IMAGE_INVOKE_WINDOW;
        budget.reserve_images_at(4, at).expect("a new window").settle(4);
        // The old window's reservation, given back now, does not free images of the new one.
        drop(held);
        assert_eq!(budget.images_used(), 4);
        assert!(budget.reserve_images_at(1, at).is_err());
    }
}
