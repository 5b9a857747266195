//! The per-user job index of `listJobs` (bucket `<prefix>_job_index`), its paging and the per-user cap.
//!
//! **Why an index.** JetStream reads a bucket only in the order its values were last written (a consumer or a
//! direct get walks the stream forward; there is no ordered scan of keys, and no backward read), so a user's
//! newest jobs cannot be found among the job records without reading all of them. `listJobs` used to do exactly
//! that, and its cost — and the memory of the front answering it — grew with every job the user ran in the
//! retention. Time-ordered record keys would not help either: keys are not read in key order. So each user's
//! jobs are also kept in creation order, in pages:
//!
//! * `<user_key>` — the **head** ([`IndexHead`]): the open page (the newest entries, at most `page` of them), the
//!   number of sealed pages, the oldest page still counted and that page's newest creation time;
//! * `<user_key>.<n>` — **sealed page** `n` ([`IndexPage`]): `page` entries, written once when the open page was
//!   full, never again.
//!
//! An entry ([`IndexEntry`]) holds what never changes about a job: its id, creation time, tool id and
//! `clientTag`, so those filters are applied on the index; the state (which changes) is read from the records,
//! the last message of each key, in one batched direct get. Entry `i` of page `n` has the **ordinal**
//! `n × page + i` (the open page continues after the sealed ones); a [`ListCursor`] is an ordinal to continue
//! below, and stays valid while pages seal. A listing reads the head, the sealed pages it reaches (several per
//! batched direct get) and the records of its candidates (one batched direct get per round): a default page is
//! 2–3 round trips, whatever the number of jobs the user has. A call examines at most
//! [`LIST_SCAN_ENTRIES_MAX`] entries and reads at most [`LIST_SCAN_RECORDS_MAX`] records; a filter that matches
//! rarely may end a page early with a cursor (`truncated`).
//!
//! **Writes.** A job is added by compare-and-set on the head at its creation ([`Store::create_job`]); the head
//! is read while the quota slot is taken and written while the record is created. When the open page is full it
//! is written as the next sealed page first (a retried seal writes the same page: its content is fixed by the
//! head it came from), then the head moves on.
//!
//! **The cap.** A user's index counts the entries of its open page and of the sealed pages from `first` on;
//! at `max_retained_jobs_per_user` ([`limits::MAX_RETAINED_JOBS_PER_USER`](fleet_proto::limits)) a new job is
//! refused ([`StoreError::RetainedQuotaExceeded`]) unless the oldest counted page's newest job was created a
//! retention ago — then that page stops being counted (its jobs cannot be listed any more: the lookback is 7
//! days, the retention 8) and the new job takes its room. Room frees a page at a time, and nothing is ever
//! evicted: every job keeps its retention. The head is rewritten at every creation, so it lives as long as its
//! user creates jobs; a sealed page was written before the head's last write and expires first. A user who
//! creates nothing for a retention loses the head with everything else, and starts a new index (another
//! `epoch`: the old index's cursors end).
//!
//! **The storage account.** The count alone would let one user keep 10 000 records of up to 384 KiB and their
//! progress rings (up to 500 events of 9 KiB each) — tens of GiB of the JetStream store every tenant shares. So
//! the head also counts the bytes its user's jobs keep, per hour of creation ([`IndexHead::stored`]): admission
//! (the same compare-and-set) refuses a job unless the account plus the most one job can keep
//! ([`job_storage_reserve`](crate::StoreSettings::job_storage_reserve)) fits in `max_job_bytes_per_user`
//! ([`StoreError::StorageQuotaExceeded`], with when the oldest hour frees), and adds that reserve. The job's
//! terminal write replaces the reserve by what the job keeps — its record's bytes and its ring's
//! ([`Store::settle_storage`], a compare-and-set on the head beside the slot's release, off the caller's path).
//! An hour leaves the account once its jobs' data is gone from the store: a job's last write comes by its
//! deadline (≤ 24 h), and its record and events are kept a retention after that. The account never counts less
//! than the store keeps, except for jobs still running when their user's index expired (a retention without a
//! creation) — at most `max_active` jobs.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::str::FromStr;

use fleet_proto::api::{JobId, user_key};
use fleet_proto::util::now_ms;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::cas::{self, Conflict, Races};
use super::direct::{self, BatchRequest, MULTI_LAST_MAX};
use super::settings::{INDEX_TOOL_ID_MAX_BYTES, JOB_INDEX_MAX_BYTES, STORAGE_SPAN_MS};
use super::{JobFilter, JobRecord, Op, Revisioned, Store, StoreError, encode, is_marker, read};

/// Index entries one `listJobs` call examines at most (a page of the default size is 32 entries).
pub const LIST_SCAN_ENTRIES_MAX: usize = 2048;

/// Job records one `listJobs` call reads at most: twice the largest `limit` and its probe, so a filter that
/// matches one job in two still fills a full page.
pub const LIST_SCAN_RECORDS_MAX: usize = 2 * (fleet_proto::limits::LIST_JOBS_LIMIT_MAX as usize + 1);

/// Sealed pages read per request while a listing goes back in time.
const PAGES_PER_READ: u64 = 4;

/// How far out of creation order the index may hold entries: a job's creation time is taken before its quota
/// slot, its entry written after, so two replicas admitting the same user's jobs at once may append them in the
/// other order. A listing stops at the first entry created this long before its `since`.
pub const INDEX_ORDER_SLACK_MS: u64 = 60_000;

const LIMIT: (&str, usize) = ("job index", JOB_INDEX_MAX_BYTES);

/// One job in its user's index: what never changes about it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IndexEntry {
    /// The job.
    pub id: JobId,
    /// Its creation time (epoch ms).
    pub at: u64,
    /// Its tool id; `None` when longer than [`INDEX_TOOL_ID_MAX_BYTES`] (checked on the record instead).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool: Option<String>,
    /// Its `clientTag`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tag: Option<String>,
}

impl IndexEntry {
    /// The entry of a new job.
    pub fn of(record: &JobRecord) -> IndexEntry {
        IndexEntry {
            id: record.job_id.clone(),
            at: record.created_at_ms,
            tool: (record.tool_id.len() <= INDEX_TOOL_ID_MAX_BYTES).then(|| record.tool_id.clone()),
            tag: record.client_tag.clone(),
        }
    }

    /// Whether the job may match `filter` (its state is checked on the record).
    fn may_match(&self, filter: &JobFilter) -> bool {
        filter
            .tool_id
            .as_ref()
            .is_none_or(|t| self.tool.as_ref().is_none_or(|mine| mine == t))
            && filter
                .client_tag
                .as_ref()
                .is_none_or(|t| self.tag.as_ref() == Some(t))
            && filter.since_ms.is_none_or(|s| self.at >= s)
    }
}

/// `<user_key>`: the open page and what the index counts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IndexHead {
    /// The real user id.
    pub user: String,
    /// Random, per index: a head created again after expiring is another index (its cursors differ).
    pub epoch: u64,
    /// Entries per page (fixed for the index's life).
    pub page: usize,
    /// The oldest sealed page counted (older ones left the retention window).
    pub first: u64,
    /// The newest creation time in page `first`, when `first < sealed`.
    #[serde(default)]
    pub first_newest_ms: Option<u64>,
    /// Pages sealed so far: `0..sealed`.
    pub sealed: u64,
    /// The open page, oldest first.
    #[serde(default)]
    pub open: Vec<IndexEntry>,
    /// The user's storage account: bytes kept by the jobs created in each hour (the key: creation time ÷
    /// [`STORAGE_SPAN_MS`]), a reserve while a job is active, what it keeps once terminal. An hour leaves the
    /// account when its jobs' data can be stored no more ([`StoreSettings::job_storage_kept_ms`](crate::StoreSettings::job_storage_kept_ms)).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub stored: BTreeMap<u64, u64>,
    /// The creation time of the first job this head reserved for: a job created before it (admitted by a version
    /// without the account, or by a replica racing that first admission) holds no reserve here, so its terminal
    /// write settles nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stored_since_ms: Option<u64>,
}

impl IndexHead {
    fn new(user: &str, page: usize) -> IndexHead {
        IndexHead {
            user: user.to_owned(),
            epoch: rand::random(),
            page,
            first: 0,
            first_newest_ms: None,
            sealed: 0,
            open: Vec::new(),
            stored: BTreeMap::new(),
            stored_since_ms: None,
        }
    }

    /// Bytes the account holds.
    pub fn stored_bytes(&self) -> u64 {
        self.stored.values().fold(0, |a, b| a.saturating_add(*b))
    }

    /// Drops the hours whose jobs' data is gone by `now`.
    fn forget_stored(&mut self, now: u64, kept_ms: u64) {
        self.stored
            .retain(|hour, _| storage_gone_at(*hour, kept_ms) > now);
    }

    /// When the oldest hour of the account leaves it, from `now` (≥ 1).
    fn stored_frees_in(&self, now: u64, kept_ms: u64) -> u64 {
        self.stored
            .keys()
            .next()
            .map_or(1, |hour| storage_gone_at(*hour, kept_ms).saturating_sub(now))
            .max(1)
    }

    fn page_len(&self) -> u64 {
        u64::try_from(self.page).unwrap_or(u64::MAX)
    }

    /// Entries counted against the cap.
    pub fn count(&self) -> usize {
        let pages = usize::try_from(self.sealed.saturating_sub(self.first)).unwrap_or(usize::MAX);
        pages.saturating_mul(self.page).saturating_add(self.open.len())
    }

    /// The ordinal the next entry gets.
    fn end(&self) -> u64 {
        self.sealed
            .saturating_mul(self.page_len())
            .saturating_add(u64::try_from(self.open.len()).unwrap_or(u64::MAX))
    }
}

/// `<user_key>.<n>`: a sealed page.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IndexPage {
    /// The real user id.
    pub user: String,
    /// The index it belongs to.
    pub epoch: u64,
    /// Oldest first.
    pub entries: Vec<IndexEntry>,
}

/// Where a listing stopped: the next call with it examines the user's jobs older than that (an opaque string on
/// the wire). A cursor of an index that expired since ends the listing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ListCursor {
    epoch: u64,
    before: u64,
}

impl fmt::Display for ListCursor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:x}.{:x}", self.epoch, self.before)
    }
}

/// A string that is not a [`ListCursor`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not a listJobs cursor")]
pub struct ListCursorError;

impl FromStr for ListCursor {
    type Err = ListCursorError;

    fn from_str(s: &str) -> Result<ListCursor, ListCursorError> {
        let hex = |part: &str| {
            if part.is_empty() || part.len() > 16 || !part.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(ListCursorError);
            }
            u64::from_str_radix(part, 16).map_err(|_| ListCursorError)
        };
        let (epoch, before) = s.split_once('.').ok_or(ListCursorError)?;
        Ok(ListCursor {
            epoch: hex(epoch)?,
            before: hex(before)?,
        })
    }
}

/// One page of a listing ([`Store::list_jobs`]).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct JobPage {
    /// Newest first.
    pub jobs: Vec<JobRecord>,
    /// More jobs may match: more matched than the limit, or the call's scan ended before the user's oldest job.
    pub truncated: bool,
    /// Where to continue (present exactly when `truncated`).
    pub cursor: Option<ListCursor>,
}

/// When the data of the jobs created in `hour` is gone: the hour's end, plus how long a job's bytes are kept.
fn storage_gone_at(hour: u64, kept_ms: u64) -> u64 {
    hour.saturating_add(1)
        .saturating_mul(STORAGE_SPAN_MS)
        .saturating_add(kept_ms)
}

/// The storage account's key of a job created at `at_ms`.
fn storage_hour(at_ms: u64) -> u64 {
    at_ms / STORAGE_SPAN_MS
}

fn ms(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl Store {
    /// The user's index head (`None`: the user created no job within the retention).
    pub(crate) async fn index_head(&self, user: &str) -> Result<Option<Revisioned<IndexHead>>, StoreError> {
        read::<IndexHead>(&self.inner.index, &user_key(user), Op::IndexJob).await
    }

    /// Adds a new job to its user's index, by compare-and-set on the head (retried on conflict; the cap check
    /// and the append are one atomic step, however many replicas race). `prefetched` is a read of the head
    /// taken earlier (its revision is checked by the write). Adding a job the open page holds already changes
    /// nothing.
    pub(crate) async fn index_job(
        &self,
        record: &JobRecord,
        prefetched: Result<Option<Revisioned<IndexHead>>, StoreError>,
        retried: bool,
    ) -> Result<(), StoreError> {
        let settings = &self.inner.settings;
        let user = record.user.as_str();
        let key = user_key(user);
        let entry = IndexEntry::of(record);
        let retention_ms = ms(settings.job_retention);
        let cap = settings.max_retained_jobs_per_user;
        let mut prefetched = prefetched.ok();
        let mut races = Races::new();
        loop {
            let current = match prefetched.take() {
                Some(head) => head,
                None => self.index_head(user).await?,
            };
            let (mut head, revision) = match current {
                Some(r) if r.value.user == user => (r.value, Some(r.revision)),
                Some(_) => {
                    return Err(StoreError::invalid(
                        Op::IndexJob,
                        "user",
                        "another user's index holds this user's key",
                    ));
                }
                None => (IndexHead::new(user, settings.job_index_page), None),
            };
            if head.open.iter().any(|e| e.id == entry.id) {
                return Ok(());
            }
            // A retried creation (its slot was taken already) whose first attempt was indexed, after which the
            // open page was sealed: the entry — and its reserve — are there already. (Two seals between the
            // attempts, more than a page of creations within the retry, are not looked for.)
            if retried && head.first < head.sealed && self.in_last_sealed_page(&head, &entry.id).await? {
                return Ok(());
            }
            while head.count() >= cap {
                let now = now_ms();
                match head.first_newest_ms {
                    Some(newest)
                        if head.first < head.sealed && newest.saturating_add(retention_ms) <= now =>
                    {
                        self.drop_oldest_page(&key, &mut head).await?;
                    }
                    newest => {
                        return Err(StoreError::RetainedQuotaExceeded {
                            retained: head.count(),
                            max: cap,
                            retry_after_ms: newest
                                .map_or(retention_ms, |n| {
                                    n.saturating_add(retention_ms).saturating_sub(now)
                                })
                                .max(1),
                        });
                    }
                }
            }
            let now = now_ms();
            let (kept_ms, reserve, budget) = (
                settings.job_storage_kept_ms(),
                settings.job_storage_reserve(),
                settings.max_job_bytes_per_user,
            );
            head.forget_stored(now, kept_ms);
            let stored = head.stored_bytes();
            if stored.saturating_add(reserve) > budget {
                return Err(StoreError::StorageQuotaExceeded {
                    stored,
                    reserve,
                    max: budget,
                    retry_after_ms: head.stored_frees_in(now, kept_ms),
                });
            }
            if head.open.len() >= head.page {
                self.seal_open_page(&key, &mut head).await?;
            }
            let hour = head.stored.entry(storage_hour(record.created_at_ms)).or_insert(0);
            *hour = hour.saturating_add(reserve);
            head.stored_since_ms.get_or_insert(record.created_at_ms);
            head.open.push(entry.clone());
            match cas::write(&self.inner.index, &key, &head, revision, LIMIT, Op::IndexJob).await? {
                Ok(_) => return Ok(()),
                Err(Conflict) => races
                    .lost()
                    .await
                    .map_err(|c| StoreError::contended(Op::IndexJob, &key, c))?,
            }
        }
    }

    /// Whether the newest sealed page of `head`'s index lists `id`.
    async fn in_last_sealed_page(&self, head: &IndexHead, id: &JobId) -> Result<bool, StoreError> {
        let last = head.sealed.saturating_sub(1);
        let page = self.read_pages(head, &[last]).await?;
        Ok(page
            .into_iter()
            .flatten()
            .any(|entries| entries.iter().any(|e| e.id == *id)))
    }

    /// Writes the open page as sealed page `head.sealed` and empties it (in `head`; the caller writes it).
    async fn seal_open_page(&self, key: &str, head: &mut IndexHead) -> Result<(), StoreError> {
        let page = IndexPage {
            user: head.user.clone(),
            epoch: head.epoch,
            entries: std::mem::take(&mut head.open),
        };
        let newest = page.entries.iter().map(|e| e.at).max().unwrap_or(0);
        let bytes = encode(&page, LIMIT, Op::IndexJob)?;
        self.inner
            .index
            .put(format!("{key}.{}", head.sealed), bytes)
            .await
            .map_err(|e| StoreError::nats(Op::IndexJob, e))?;
        if head.first == head.sealed {
            head.first_newest_ms = Some(newest);
        }
        head.sealed += 1;
        Ok(())
    }

    /// Stops counting page `head.first` (in `head`; the caller writes it) and learns the next one's newest time.
    async fn drop_oldest_page(&self, key: &str, head: &mut IndexHead) -> Result<(), StoreError> {
        head.first += 1;
        head.first_newest_ms = None;
        if head.first < head.sealed {
            let page =
                read::<IndexPage>(&self.inner.index, &format!("{key}.{}", head.first), Op::IndexJob).await?;
            // A page that expired already held only jobs created before the window.
            head.first_newest_ms = Some(
                page.filter(|p| p.value.epoch == head.epoch)
                    .and_then(|p| p.value.entries.iter().map(|e| e.at).max())
                    .unwrap_or(0),
            );
        }
        Ok(())
    }

    /// Replaces a job's reserve in its user's storage account by `kept`, the bytes it keeps now that it is
    /// terminal (its record and its ring), by compare-and-set on the head. Called once per job, by whoever wrote
    /// its terminal record (the state machine allows one terminal write). Nothing changes for a job created before
    /// the account's first reserve ([`IndexHead::stored_since_ms`]: it reserved nothing), nor when the account no
    /// longer holds the job's hour (an index created again after expiring).
    pub(crate) async fn settle_storage(&self, record: &JobRecord, kept: u64) -> Result<(), StoreError> {
        let key = user_key(&record.user);
        let hour = storage_hour(record.created_at_ms);
        let reserve = self.inner.settings.job_storage_reserve();
        cas::compare_and_set(
            cas::Target {
                kv: &self.inner.index,
                key: &key,
                op: Op::IndexJob,
                limit: LIMIT,
            },
            None,
            |current: Option<Revisioned<IndexHead>>| {
                let Some(mut head) = current.map(|c| c.value).filter(|h| {
                    h.user == record.user
                        && h.stored_since_ms
                            .is_some_and(|since| record.created_at_ms >= since)
                }) else {
                    return Ok::<_, StoreError>(cas::Edit::Keep(()));
                };
                let Some(bytes) = head.stored.get_mut(&hour) else {
                    return Ok(cas::Edit::Keep(()));
                };
                *bytes = bytes.saturating_sub(reserve).saturating_add(kept);
                Ok(cas::Edit::Write(head, ()))
            },
        )
        .await?;
        Ok(())
    }

    /// Bytes `user`'s storage account holds now (reserves of active jobs included): what admission compares with
    /// [`StoreSettings::max_job_bytes_per_user`](crate::StoreSettings::max_job_bytes_per_user).
    pub async fn stored_job_bytes(&self, user: &str) -> Result<u64, StoreError> {
        let kept_ms = self.inner.settings.job_storage_kept_ms();
        Ok(self
            .index_head(user)
            .await?
            .filter(|h| h.value.user == user)
            .map_or(0, |h| {
                let mut head = h.value;
                head.forget_stored(now_ms(), kept_ms);
                head.stored_bytes()
            }))
    }

    /// One user's jobs matching `filter`, newest first (in the order they were admitted), at most `limit` (≥ 1),
    /// from `cursor` on (the previous page's, to continue; `None` for the newest). Reads only the user's index and
    /// the records of its candidates: the cost depends on `limit` and on how rarely the filter matches, never on
    /// how many jobs the user has (see the [module docs](self)). Records that do not parse are skipped (and
    /// logged).
    pub async fn list_jobs(
        &self,
        user: &str,
        filter: &JobFilter,
        limit: usize,
        cursor: Option<ListCursor>,
    ) -> Result<JobPage, StoreError> {
        if limit == 0 {
            return Err(StoreError::invalid(Op::ListJobs, "limit", "must be at least 1"));
        }
        let Some(head) = read::<IndexHead>(&self.inner.index, &user_key(user), Op::ListJobs).await? else {
            return Ok(JobPage::default());
        };
        let head = head.value;
        let before = match cursor {
            None => head.end(),
            Some(c) if c.epoch == head.epoch => c.before.min(head.end()),
            Some(_) => return Ok(JobPage::default()),
        };
        if head.user != user {
            return Ok(JobPage::default());
        }
        let mut scan = IndexScan {
            head: &head,
            next: before,
            lowest: head.first.saturating_mul(head.page_len()),
            pages: HashMap::new(),
        };
        let floor = filter.since_ms.unwrap_or(0).saturating_sub(INDEX_ORDER_SLACK_MS);
        let mut matched: Vec<(u64, JobRecord)> = Vec::new();
        let mut seen = HashSet::new();
        let (mut examined, mut read_count, mut ended) = (0usize, 0usize, false);
        loop {
            let mut candidates: Vec<(u64, IndexEntry)> = Vec::new();
            let need = limit + 1 - matched.len();
            while candidates.len() < need
                && examined < LIST_SCAN_ENTRIES_MAX
                && read_count + candidates.len() < LIST_SCAN_RECORDS_MAX
            {
                let Some((ordinal, entry)) = self.previous_entry(&mut scan).await? else {
                    ended = true;
                    break;
                };
                examined += 1;
                if entry.at < floor {
                    ended = true;
                    break;
                }
                if entry.may_match(filter) && seen.insert(entry.id.clone()) {
                    candidates.push((ordinal, entry));
                }
            }
            if candidates.is_empty() {
                break;
            }
            read_count += candidates.len();
            let records = self.read_records(user, &candidates).await?;
            for ((ordinal, _), record) in candidates.into_iter().zip(records) {
                if let Some(r) = record
                    && r.user == user
                    && filter.matches(&r)
                {
                    matched.push((ordinal, r));
                }
            }
            if matched.len() > limit || ended {
                break;
            }
        }
        let ended = ended || scan.next <= scan.lowest;
        let mut page = JobPage::default();
        if matched.len() > limit {
            matched.truncate(limit);
            page.truncated = true;
            page.cursor = matched.last().map(|(ordinal, _)| ListCursor {
                epoch: head.epoch,
                before: *ordinal,
            });
        } else if !ended {
            // The call's scan budget ran out first.
            page.truncated = true;
            page.cursor = Some(ListCursor {
                epoch: head.epoch,
                before: scan.next,
            });
        }
        page.jobs = matched.into_iter().map(|(_, r)| r).collect();
        Ok(page)
    }

    /// The entry before `scan.next` (loading the sealed pages it needs, a few per request); `None` at the end
    /// (the oldest counted page passed, or a page gone).
    async fn previous_entry(
        &self,
        scan: &mut IndexScan<'_>,
    ) -> Result<Option<(u64, IndexEntry)>, StoreError> {
        let head = scan.head;
        if scan.next <= scan.lowest {
            return Ok(None);
        }
        let ordinal = scan.next - 1;
        let page_len = head.page_len();
        let (page, index) = (
            ordinal / page_len,
            usize::try_from(ordinal % page_len).unwrap_or(usize::MAX),
        );
        let entry = if page == head.sealed {
            head.open.get(index).cloned()
        } else {
            if !scan.pages.contains_key(&page) {
                let oldest = page.saturating_sub(PAGES_PER_READ - 1).max(head.first);
                let wanted: Vec<u64> = (oldest..=page).rev().collect();
                let loaded = self.read_pages(head, &wanted).await?;
                scan.pages.extend(wanted.into_iter().zip(loaded));
            }
            scan.pages
                .get(&page)
                .and_then(|p| p.as_ref())
                .and_then(|entries| entries.get(index).cloned())
        };
        let Some(entry) = entry else {
            scan.next = scan.lowest;
            return Ok(None);
        };
        scan.next = ordinal;
        Ok(Some((ordinal, entry)))
    }

    /// Sealed pages `numbers` of `head`'s index, in one batched direct get (`None`: gone, or another index's).
    async fn read_pages(
        &self,
        head: &IndexHead,
        numbers: &[u64],
    ) -> Result<Vec<Option<Vec<IndexEntry>>>, StoreError> {
        let key = user_key(&head.user);
        let keys: Vec<String> = numbers.iter().map(|n| format!("{key}.{n}")).collect();
        let pages = self.current_values::<IndexPage>(&self.inner.index, &keys).await?;
        Ok(pages
            .into_iter()
            .map(|p| {
                p.filter(|p| p.epoch == head.epoch && p.user == head.user)
                    .map(|p| p.entries)
            })
            .collect())
    }

    /// The records of `candidates` (in their order; `None` for a missing one), in one batched direct get.
    async fn read_records(
        &self,
        user: &str,
        candidates: &[(u64, IndexEntry)],
    ) -> Result<Vec<Option<JobRecord>>, StoreError> {
        let key = user_key(user);
        let keys: Vec<String> = candidates
            .iter()
            .map(|(_, e)| format!("{key}.{}", e.id))
            .collect();
        self.current_values(&self.inner.jobs, &keys).await
    }

    /// The current values of `keys` in `kv`, in their order (`None`: absent, deleted, or not parsing — logged),
    /// by batched direct gets (`multi_last`), one per [`MULTI_LAST_MAX`] keys.
    async fn current_values<T: DeserializeOwned>(
        &self,
        kv: &async_nats::jetstream::kv::Store,
        keys: &[String],
    ) -> Result<Vec<Option<T>>, StoreError> {
        let subjects: Vec<String> = keys.iter().map(|k| format!("{}{k}", kv.prefix)).collect();
        let mut by_subject = HashMap::with_capacity(subjects.len());
        for chunk in subjects.chunks(MULTI_LAST_MAX) {
            let messages = direct::batch(
                &self.inner.js.client(),
                &kv.stream_name,
                &BatchRequest {
                    start: None,
                    next_by_subject: None,
                    multi_last: chunk,
                    batch: chunk.len(),
                },
            )
            .await
            .map_err(|e| StoreError::nats(Op::ListJobs, e))?;
            for m in messages {
                if !is_marker(&m.headers) {
                    by_subject.insert(m.subject.to_string(), m.payload);
                }
            }
        }
        Ok(subjects
            .iter()
            .map(|s| {
                let bytes = by_subject.remove(s)?;
                serde_json::from_slice::<T>(&bytes)
                    .inspect_err(|e| {
                        tracing::warn!(subject = %s, error = %e, "skipping a stored value that does not parse");
                    })
                    .ok()
            })
            .collect())
    }
}

/// A listing's position in one index.
struct IndexScan<'a> {
    head: &'a IndexHead,
    /// The next entry examined is `next - 1`.
    next: u64,
    /// The first ordinal of page `head.first`: nothing below it is counted.
    lowest: u64,
    /// Sealed pages read so far.
    pages: HashMap<u64, Option<Vec<IndexEntry>>>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An hour of the storage account stays until the last millisecond its jobs' data may be stored, and leaves
    /// at it; the retry time names the oldest hour's departure.
    #[test]
    fn storage_hours_leave_the_account_when_their_data_is_gone() {
        let kept = 9 * 24 * 3_600_000;
        let mut head = IndexHead::new("u", 4);
        let (h1, h2) = (
            storage_hour(5 * STORAGE_SPAN_MS + 1),
            storage_hour(7 * STORAGE_SPAN_MS),
        );
        assert_eq!((h1, h2), (5, 7));
        head.stored.insert(h1, 100);
        head.stored.insert(h2, 20);
        assert_eq!(head.stored_bytes(), 120);
        let gone = 6 * STORAGE_SPAN_MS + kept;
        assert_eq!(storage_gone_at(h1, kept), gone);
        assert_eq!(head.stored_frees_in(gone - 10, kept), 10);
        head.forget_stored(gone - 1, kept);
        assert_eq!(head.stored_bytes(), 120, "one millisecond before, the hour stays");
        head.forget_stored(gone, kept);
        assert_eq!(head.stored_bytes(), 20, "at its end it leaves");
        assert_eq!(head.stored_frees_in(gone, kept), 2 * STORAGE_SPAN_MS);
        head.stored.clear();
        assert_eq!(
            head.stored_frees_in(gone, kept),
            1,
            "an empty account: at least 1 ms"
        );
        // Saturating, never wrapping: a sum past u64::MAX is u64::MAX.
        head.stored.insert(1, u64::MAX);
        head.stored.insert(2, 1);
        assert_eq!(head.stored_bytes(), u64::MAX);
        // The account round-trips, and a head written before the account existed reads as an empty one.
        let json = serde_json::to_value(&head).expect("json");
        assert_eq!(serde_json::from_value::<IndexHead>(json).expect("back"), head);
        let mut old = serde_json::to_value(IndexHead::new("u", 4)).expect("json");
        assert!(old.get("stored").is_none(), "an empty account is not written");
        old.as_object_mut().expect("object").remove("stored");
        assert!(
            serde_json::from_value::<IndexHead>(old)
                .expect("old head")
                .stored
                .is_empty()
        );
    }

    #[test]
    fn cursors_round_trip_and_refuse_anything_else() {
        let c = ListCursor {
            epoch: u64::MAX,
            before: 1234,
        };
        assert_eq!(c.to_string().parse::<ListCursor>(), Ok(c));
        let zero = ListCursor { epoch: 0, before: 0 };
        assert_eq!("0.0".parse::<ListCursor>(), Ok(zero));
        for bad in [
            "",
            ".",
            "1.",
            ".1",
            "1",
            "1.2.3",
            "g.1",
            "+1.1",
            "1.-1",
            "10000000000000000.1",
            " 1.1",
        ] {
            assert_eq!(bad.parse::<ListCursor>(), Err(ListCursorError), "{bad:?}");
        }
    }

    #[test]
    fn an_entry_checks_what_it_holds_and_leaves_the_rest_to_the_record() {
        let entry = IndexEntry {
            id: JobId::from_bytes([7; 16]),
            at: 5_000,
            tool: Some("echo.echo".into()),
            tag: Some("t".into()),
        };
        let f = |tool: Option<&str>, tag: Option<&str>, since: Option<u64>| JobFilter {
            tool_id: tool.map(str::to_owned),
            client_tag: tag.map(str::to_owned),
            since_ms: since,
            states: vec![fleet_proto::api::JobState::Failed],
        };
        assert!(
            entry.may_match(&f(None, None, None)),
            "the state is the record's to check"
        );
        assert!(entry.may_match(&f(Some("echo.echo"), Some("t"), Some(5_000))));
        assert!(!entry.may_match(&f(Some("echo.other"), None, None)));
        assert!(!entry.may_match(&f(None, Some("u"), None)));
        assert!(!entry.may_match(&f(None, None, Some(5_001))));
        let long_tool = IndexEntry { tool: None, ..entry };
        assert!(
            long_tool.may_match(&f(Some("anything"), None, None)),
            "an unkept tool id is the record's to check"
        );
    }

    #[test]
    fn the_largest_page_of_the_largest_entries_fits_the_bucket() {
        use crate::settings::{JOB_INDEX_MAX_BYTES, JOB_INDEX_PAGE_MAX};
        // Control characters take six bytes each in JSON (`\u0001`): the worst a tool id, a tag and a user can be.
        let worst = |chars: usize| "\u{1}".repeat(chars);
        let record: JobRecord = serde_json::from_value(serde_json::json!({
            "job_id": JobId::from_bytes([1; 16]), "user": "u", "plugin": "p", "tool": "t", "state": "queued",
            "created_at_ms": 1, "updated_at_ms": 1, "deadline_ms": 2, "timeout_ms": 1,
            "tool_id": worst(INDEX_TOOL_ID_MAX_BYTES),
            "client_tag": worst(fleet_proto::limits::MAX_CLIENT_TAG_CHARS),
        }))
        .expect("a record");
        let entry = IndexEntry::of(&record);
        assert!(entry.tool.is_some(), "a tool id of the bound is kept");
        let mut head = IndexHead::new(&worst(256), JOB_INDEX_PAGE_MAX);
        head.first_newest_ms = Some(u64::MAX);
        head.open = vec![entry; JOB_INDEX_PAGE_MAX];
        // And a full storage account: every hour whose data may still be stored (the kept time and the current
        // hour), each at the largest key and value.
        let kept = crate::StoreSettings::default().job_storage_kept_ms();
        let hours = kept / STORAGE_SPAN_MS + 2;
        let last = u64::MAX / STORAGE_SPAN_MS;
        head.stored = (last - hours..last).map(|h| (h, u64::MAX)).collect();
        head.stored_since_ms = Some(u64::MAX);
        let bytes = serde_json::to_vec(&head).expect("json").len();
        assert!(bytes <= JOB_INDEX_MAX_BYTES, "{bytes} > {JOB_INDEX_MAX_BYTES}");
        // One byte more of tool id and it is not kept (the record's is checked instead).
        let longer = JobRecord {
            tool_id: "t".repeat(INDEX_TOOL_ID_MAX_BYTES + 1),
            ..record
        };
        assert_eq!(IndexEntry::of(&longer).tool, None);
    }

    #[test]
    fn the_head_counts_its_open_page_and_the_sealed_pages_from_first() {
        let mut head = IndexHead::new("u", 4);
        assert_eq!((head.count(), head.end()), (0, 0));
        head.sealed = 3;
        head.first = 1;
        head.open = vec![
            IndexEntry {
                id: JobId::from_bytes([1; 16]),
                at: 1,
                tool: None,
                tag: None,
            };
            2
        ];
        assert_eq!((head.count(), head.end()), (2 * 4 + 2, 3 * 4 + 2));
    }
}
