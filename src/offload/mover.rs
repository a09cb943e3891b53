//! `BlockMover`: the worker side of the offload connector.
//!
//! An engine keeps its KV cache as block tensors, `(num_blocks, page_bytes)` each, and groups
//! them into KV-cache groups (DeepSeek-V3.2: the MLA layers' tensors, and the indexer's), each
//! group's layers referring to tensors with the bytes of a block they use. The host side is
//! one pool per tensor, `(num_chunks, page_bytes * blocks_per_chunk)`: chunk `c` holds blocks
//! `c * bpc .. c * bpc + bpc` of that tensor, so a chunk id means the same rows in every pool.
//!
//! A job names device blocks (per group: `group_sizes`, and `block_indices`, the first
//! block's index in its request, which says where in its first chunk a group starts) and
//! chunks. The mover expands them into (device block, host block) pairs per group, makes one
//! page transfer per distinct (tensor, bytes) a group refers to, submits them as one group
//! on a copy engine, and reports the job's outcome: every byte written, or failed.
//!
//! A job's buffers are the bindings made at construction: the caller keeps the tensors alive
//! for the mover's life, and [`BlockMover::shutdown`] waits for every job before it returns.

use crate::error::{Error, Result};
use crate::transfer::{
    CopyEngine, Direction, Granularity, LayerStatus, MemoryKind, PageTransferBinding,
    PageTransferGroup, PageTransferMap, PreparedPageTransfer, TransferEvents,
};
use rustc_hash::FxHashMap;
use std::sync::Arc;
use std::time::Duration;

/// One engine block tensor and its host pool.
#[derive(Debug, Clone, Copy)]
pub struct BlockTensor {
    /// The device tensor's first byte, byte length, blocks and row stride.
    pub device_base: u64,
    /// Bytes of the device tensor.
    pub device_len: u64,
    /// Blocks of the device tensor.
    pub blocks: u32,
    /// Bytes between consecutive device blocks.
    pub block_stride: u64,
    /// Where the device tensor lives (host memory in tests without a GPU).
    pub device_kind: MemoryKind,
    /// The CUDA ordinal of device memory.
    pub ordinal: Option<u32>,
    /// The host pool's first byte and byte length.
    pub host_base: u64,
    /// Bytes of the host pool.
    pub host_len: u64,
    /// The block size of the pool: a host block's stride (the tensor's page size).
    pub page_bytes: u64,
}

/// A layer's use of a tensor: which, and how many bytes of each block it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ref {
    /// Index into the tensors.
    pub tensor: usize,
    /// Bytes of a block the layer uses (at most the page).
    pub bytes: u64,
}

/// A job as the engine gives it.
#[derive(Debug, Clone)]
pub struct JobSpec {
    /// `Backup` for a store (device to host), `Load` for a load.
    pub direction: Direction,
    /// Device block ids, group by group.
    pub blocks: Vec<i64>,
    /// Blocks of each group.
    pub group_sizes: Vec<i64>,
    /// Each group's first block's index in its request.
    pub block_indices: Vec<i64>,
    /// Chunk ids, group by group.
    pub chunks: Vec<i64>,
}

/// A finished job.
#[derive(Debug, Clone, PartialEq)]
pub struct JobOutcome {
    /// The engine's job id.
    pub job_id: u64,
    /// Every byte written.
    pub success: bool,
    /// Bytes moved (or meant to be, for a failed job).
    pub bytes: u64,
    /// Seconds from submission to the last byte written.
    pub seconds: f64,
    /// Why it failed.
    pub error: Option<String>,
}

struct Job {
    job_id: u64,
    events: Option<Arc<TransferEvents>>,
    bytes: u64,
}

/// The mover (module docs).
pub struct BlockMover {
    tensors: Vec<BlockTensor>,
    groups: Vec<Vec<Ref>>,
    blocks_per_chunk: u32,
    chunks: u32,
    /// (device, host) bindings of each distinct (tensor, bytes).
    bindings: FxHashMap<Ref, (PageTransferBinding, PageTransferBinding)>,
    engine: Arc<dyn CopyEngine>,
    expedited: Arc<dyn CopyEngine>,
    jobs: Vec<Job>,
}

impl std::fmt::Debug for BlockMover {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlockMover")
            .field("tensors", &self.tensors.len())
            .field("groups", &self.groups.len())
            .field("jobs", &self.jobs.len())
            .finish()
    }
}

impl BlockMover {
    /// A mover over `tensors` (and their host pools of `chunks` chunks of `blocks_per_chunk`
    /// blocks), for KV-cache `groups` of refs, copying on `engine` (and `expedited` for loads
    /// the engine waits on within its step).
    ///
    /// # Safety
    /// Every tensor's device and host ranges must stay valid, written by nothing but this
    /// mover's engines while a job is in flight, until [`Self::shutdown`] returned (or the
    /// mover dropped).
    pub unsafe fn new(
        tensors: Vec<BlockTensor>,
        groups: Vec<Vec<Ref>>,
        blocks_per_chunk: u32,
        chunks: u32,
        engine: Arc<dyn CopyEngine>,
        expedited: Arc<dyn CopyEngine>,
    ) -> Result<Self> {
        if blocks_per_chunk == 0 {
            return Err(Error::config("blocks_per_chunk", 0, "an integer >= 1"));
        }
        if tensors.is_empty() {
            return Err(Error::config(
                "kv_caches.tensors",
                "none",
                "at least one tensor",
            ));
        }
        let host_blocks = chunks.checked_mul(blocks_per_chunk).ok_or_else(|| {
            Error::config(
                "num_chunks x blocks_per_chunk",
                u64::from(chunks) * u64::from(blocks_per_chunk),
                "fewer than 2^32 host blocks",
            )
        })?;
        let mut bindings = FxHashMap::default();
        for (g, refs) in groups.iter().enumerate() {
            for (i, r) in refs.iter().enumerate() {
                let field = |f: &str| format!("kv_caches.group_data_refs[{g}][{i}].{f}");
                let t = tensors.get(r.tensor).ok_or_else(|| {
                    Error::config(
                        field("tensor_idx"),
                        r.tensor,
                        format!("an index below {}", tensors.len()),
                    )
                })?;
                if r.bytes == 0 || r.bytes > t.page_bytes {
                    return Err(Error::config(
                        field("page_size_bytes"),
                        r.bytes,
                        format!("1 to the tensor's page size, {}", t.page_bytes),
                    ));
                }
                if bindings.contains_key(r) || host_blocks == 0 {
                    continue;
                }
                // SAFETY: the caller guarantees both ranges (this function's contract);
                // `blocks` checks that every block lies inside them.
                let mut dev = unsafe {
                    PageTransferBinding::blocks(
                        t.device_base,
                        t.device_len,
                        t.blocks,
                        r.bytes,
                        t.block_stride,
                        t.device_kind,
                    )
                }?;
                if let Some(o) = t.ordinal {
                    dev = dev.on_device(o);
                }
                // SAFETY: as above, for the host pool.
                let host = unsafe {
                    PageTransferBinding::blocks(
                        t.host_base,
                        t.host_len,
                        host_blocks,
                        r.bytes,
                        t.page_bytes,
                        MemoryKind::Host,
                    )
                }?;
                bindings.insert(*r, (dev, host));
            }
        }
        Ok(BlockMover {
            tensors,
            groups,
            blocks_per_chunk,
            chunks,
            bindings,
            engine,
            expedited,
            jobs: Vec::new(),
        })
    }

    /// The (device block, host block) pairs of each group of `spec`, checked.
    pub fn pairs(&self, spec: &JobSpec) -> Result<Vec<(Vec<u64>, Vec<u64>)>> {
        let n = self.groups.len();
        for (field, len) in [
            ("group_sizes", spec.group_sizes.len()),
            ("block_indices", spec.block_indices.len()),
        ] {
            if len != n {
                return Err(Error::config(
                    format!("gpu_spec.{field}"),
                    format!("{len} entries"),
                    format!("{n}: one per KV-cache group"),
                ));
            }
        }
        // (Checked: sizes past int64 in all must not wrap round to the block count.)
        let total =
            spec.group_sizes
                .iter()
                .try_fold(0i64, |t, &s| if s < 0 { None } else { t.checked_add(s) });
        if total != Some(spec.blocks.len() as i64) {
            return Err(Error::config(
                "gpu_spec.group_sizes",
                format!("{:?}", spec.group_sizes),
                format!(
                    "sizes >= 0 adding up to the {} block ids",
                    spec.blocks.len()
                ),
            ));
        }
        let bpc = i64::from(self.blocks_per_chunk);
        let mut out = Vec::with_capacity(n);
        let (mut b_at, mut c_at) = (0usize, 0usize);
        for g in 0..n {
            let size = spec.group_sizes[g] as usize;
            if size == 0 {
                out.push((Vec::new(), Vec::new()));
                continue;
            }
            let start = spec.block_indices[g];
            if start < 0 {
                return Err(Error::config(
                    format!("gpu_spec.block_indices[{g}]"),
                    start,
                    "a block index >= 0",
                ));
            }
            let skip = (start % bpc) as usize;
            let n_chunks = (size + skip).div_ceil(bpc as usize);
            let chunk_ids = spec.chunks.get(c_at..c_at + n_chunks).ok_or_else(|| {
                Error::config(
                    "cpu_spec.block_ids",
                    format!("{} chunk ids", spec.chunks.len()),
                    format!(
                        "at least {} for group {g} and those before",
                        c_at + n_chunks
                    ),
                )
            })?;
            // Blocks of the group's smallest tensor (a group without refs moves nothing).
            let max = self.groups[g]
                .iter()
                .map(|r| self.tensors[r.tensor].blocks)
                .min()
                .unwrap_or(u32::MAX);
            let mut dev = Vec::with_capacity(size);
            for (i, &b) in spec.blocks[b_at..b_at + size].iter().enumerate() {
                if b < 0 || b >= i64::from(max) {
                    return Err(Error::out_of_range(
                        format!("gpu_spec.block_ids[{}]", b_at + i),
                        b,
                        0,
                        max,
                    ));
                }
                dev.push(b as u64);
            }
            let mut host = Vec::with_capacity(size);
            for (j, &c) in chunk_ids.iter().enumerate() {
                if c < 0 || c >= i64::from(self.chunks) {
                    return Err(Error::out_of_range(
                        format!("cpu_spec.block_ids[{}]", c_at + j),
                        c,
                        0,
                        self.chunks,
                    ));
                }
                for sub in 0..bpc {
                    host.push((c * bpc + sub) as u64);
                }
            }
            let host: Vec<u64> = host.into_iter().skip(skip).take(size).collect();
            out.push((dev, host));
            b_at += size;
            c_at += n_chunks;
        }
        if c_at != spec.chunks.len() {
            return Err(Error::config(
                "cpu_spec.block_ids",
                format!("{} chunk ids", spec.chunks.len()),
                format!("{c_at}: the chunks the groups' blocks span"),
            ));
        }
        Ok(out)
    }

    /// Submits job `job_id`; returns at once. `expedited` loads go on their own engine, so
    /// they do not queue behind regular ones.
    pub fn submit(&mut self, job_id: u64, spec: &JobSpec, expedited: bool) -> Result<()> {
        if self.jobs.iter().any(|j| j.job_id == job_id) {
            return Err(Error::config(
                "job_id",
                job_id,
                "an id not already in flight on this worker",
            ));
        }
        let pairs = self.pairs(spec)?;
        let mut members = Vec::new();
        let mut bytes = 0;
        for (g, (dev, host)) in pairs.iter().enumerate() {
            if dev.is_empty() {
                continue;
            }
            let mut done: Vec<Ref> = Vec::new();
            for r in &self.groups[g] {
                if done.contains(r) {
                    continue; // layers sharing a tensor's bytes: copied once
                }
                done.push(*r);
                let (d, h) = self.bindings[r].clone();
                let (src, dst, s, t) = match spec.direction {
                    Direction::Backup => (d, h, dev, host),
                    Direction::Load => (h, d, host, dev),
                };
                let map = PageTransferMap::new(Granularity::Page, s, t)?;
                bytes += r.bytes * dev.len() as u64;
                members.push(PreparedPageTransfer::new(src, dst, map, spec.direction)?);
            }
        }
        let events = if members.is_empty() {
            None
        } else {
            let group = Arc::new(PageTransferGroup::new(members)?);
            let engine = if expedited && spec.direction == Direction::Load {
                &self.expedited
            } else {
                &self.engine
            };
            Some(engine.submit(group, None)?)
        };
        self.jobs.push(Job {
            job_id,
            events,
            bytes,
        });
        Ok(())
    }

    /// Jobs finished since the last call, in submission order.
    pub fn finished(&mut self) -> Vec<JobOutcome> {
        let mut out = Vec::new();
        self.jobs.retain(|j| {
            let Some(ev) = &j.events else {
                out.push(JobOutcome {
                    job_id: j.job_id,
                    success: true,
                    bytes: 0,
                    seconds: 0.0,
                    error: None,
                });
                return false;
            };
            if !ev.is_finished() {
                return true;
            }
            let error = ev.layers().iter().find_map(|&l| match ev.status(l) {
                Ok(LayerStatus::Failed(r)) => Some(r),
                _ => None,
            });
            let seconds = ev
                .layer_times()
                .into_iter()
                .flatten()
                .max()
                .unwrap_or(Duration::ZERO)
                .as_secs_f64();
            out.push(JobOutcome {
                job_id: j.job_id,
                success: error.is_none(),
                bytes: j.bytes,
                seconds,
                error,
            });
            false
        });
        out
    }

    /// The events of the given jobs still in flight (to wait on without the mover's lock).
    pub fn events_of(&self, job_ids: &[u64]) -> Vec<Arc<TransferEvents>> {
        self.jobs
            .iter()
            .filter(|j| job_ids.contains(&j.job_id))
            .filter_map(|j| j.events.clone())
            .collect()
    }

    /// Every job's events.
    pub fn all_events(&self) -> Vec<Arc<TransferEvents>> {
        self.jobs.iter().filter_map(|j| j.events.clone()).collect()
    }

    /// Jobs in flight or not yet reported.
    pub fn pending(&self) -> usize {
        self.jobs.len()
    }

    /// Waits for every job (the buffers may then be released).
    pub fn shutdown(&mut self) {
        for ev in self.all_events() {
            let _ = ev.wait_all(None);
        }
    }

    /// The engines, to set the producer stream on.
    pub fn engines(&self) -> [&Arc<dyn CopyEngine>; 2] {
        [&self.engine, &self.expedited]
    }
}

impl Drop for BlockMover {
    fn drop(&mut self) {
        self.shutdown();
    }
}
