//! The tiers under real engines: the native model on CPU (real KV through host memory and
//! disk) and the mocker under pressure.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use dyn_core::planes::Planes;
use dyn_protocol::types::{Generated, PreprocessedRequest};

use crate::native::{DeviceChoice, NativeConfig};
use crate::offload::{OffloadConfig, Tiers};
use crate::{EngineHandle, mocker, native};

/// A greedy request with a fixed output length.
fn greedy(tokens: Vec<u32>, max_tokens: u32) -> PreprocessedRequest {
    let mut r = dyn_protocol::testing::preprocessed(tokens, max_tokens);
    r.sampling.temperature = Some(0.0);
    r.stop.ignore_eos = true;
    r
}

async fn run(m: &EngineHandle, req: &PreprocessedRequest) -> Vec<u32> {
    let mut rx = m.submit(req, None, None).await.expect("submitted");
    let mut out = Vec::new();
    while let Some(item) = rx.recv().await {
        let Generated::Tokens { ids, finish, .. } = item.expect("no engine error") else {
            continue;
        };
        out.extend(ids);
        if finish.is_some() {
            break;
        }
    }
    out
}

use dyn_tests::until;

fn stat(t: &Tiers, f: impl Fn(&super::Stats) -> &std::sync::atomic::AtomicU64) -> u64 {
    f(&t.stats).load(Ordering::Relaxed)
}

/// Six full blocks of 4 tokens, distinct per `i`, inside the tiny model's vocabulary.
fn prompt(i: u32) -> Vec<u32> {
    (0..25).map(|t| 5 + (i * 97 + t * 13) % 600).collect()
}

/// A native worker on CPU with an 8-block pool (one prompt and its answer fill it).
async fn native_worker(offload: OffloadConfig, id: u64) -> Arc<EngineHandle> {
    native_on(DeviceChoice::Cpu, offload, id)
        .await
        .expect("starts")
}

async fn native_on(
    device: DeviceChoice,
    offload: OffloadConfig,
    id: u64,
) -> Result<Arc<EngineHandle>, dyn_core::BuildError> {
    let planes = Planes::embedded();
    let config = NativeConfig {
        num_blocks: 8,
        block_size: 4,
        device,
        threads: 1,
        offload,
        ..NativeConfig::default()
    };
    native::start(
        &config,
        &dyn_protocol::testing::cx("decode", id, &[], &planes),
    )
    .await
}

#[tokio::test]
async fn a_prompt_evicted_to_host_memory_comes_back_with_the_same_greedy_output() {
    let plain = native_worker(OffloadConfig::default(), 0x0f1).await;
    let expected = run(&plain, &greedy(prompt(0), 6)).await;

    let m = native_worker(
        OffloadConfig {
            host_blocks: 64,
            ..OffloadConfig::default()
        },
        0x0f2,
    )
    .await;
    let t = m.tiers().expect("tiers").clone();
    assert_eq!(run(&m, &greedy(prompt(0), 6)).await, expected);
    // Another prompt needs the whole pool: the first one's blocks go to host memory.
    run(&m, &greedy(prompt(1), 6)).await;
    until("the offload", || stat(&t, |s| &s.offloaded_host) >= 6).await;
    assert_eq!(
        run(&m, &greedy(prompt(0), 6)).await,
        expected,
        "onboarded KV gives the same greedy output"
    );
    assert_eq!(
        stat(&t, |s| &s.hits_host),
        6,
        "every full prompt block came back"
    );
    assert_eq!(stat(&t, |s| &s.hits_disk), 0);
    assert_eq!(stat(&t, |s| &s.dropped), 0);
}

#[tokio::test]
async fn on_cuda_blocks_leave_and_return_through_host_memory() {
    // The same path on the CUDA backend: export is a device→host copy, onboarding a
    // host→device one. Skipped, visibly, without the feature or a GPU.
    if !dyn_compute::cuda_compiled() {
        println!(
            "SKIPPED: built without the `cuda` feature (cargo test -p dyn-engine --features cuda)"
        );
        return;
    }
    let plain = match native_on(DeviceChoice::Cuda, OffloadConfig::default(), 0x0fa).await {
        Ok(m) => m,
        Err(e) => {
            println!("SKIPPED: no usable CUDA device ({e})");
            return;
        }
    };
    let expected = run(&plain, &greedy(prompt(0), 6)).await;
    let offload = OffloadConfig {
        host_blocks: 64,
        ..OffloadConfig::default()
    };
    let m = native_on(DeviceChoice::Cuda, offload, 0x0fb)
        .await
        .expect("starts");
    let t = m.tiers().expect("tiers").clone();
    assert_eq!(run(&m, &greedy(prompt(0), 6)).await, expected);
    run(&m, &greedy(prompt(1), 6)).await;
    until("the offload", || stat(&t, |s| &s.offloaded_host) >= 6).await;
    assert_eq!(run(&m, &greedy(prompt(0), 6)).await, expected);
    assert_eq!(stat(&t, |s| &s.hits_host), 6);
}

#[tokio::test]
async fn a_prompt_evicted_to_disk_comes_back_and_a_corrupted_block_is_recomputed() {
    let plain = native_worker(OffloadConfig::default(), 0x0f3).await;
    let expected = run(&plain, &greedy(prompt(0), 6)).await;
    let dir = dyn_tests::scratch_dir("offload-native-disk");
    let offload = OffloadConfig {
        host_blocks: 8,
        disk_dir: Some(dir.display().to_string()),
        disk_blocks: 256,
        ..OffloadConfig::default()
    };
    let m = native_worker(offload.clone(), 0x0f4).await;
    let t = m.tiers().expect("tiers").clone();
    run(&m, &greedy(prompt(0), 6)).await;
    // Three more prompts push the first one's blocks through host memory onto disk.
    for i in 1..4 {
        run(&m, &greedy(prompt(i), 6)).await;
    }
    until("the spill to disk", || {
        stat(&t, |s| &s.offloaded_disk) >= 12
    })
    .await;
    assert_eq!(run(&m, &greedy(prompt(0), 6)).await, expected);
    assert!(
        stat(&t, |s| &s.hits_disk) >= 4,
        "blocks read back from disk: {}",
        stat(&t, |s| &s.hits_disk)
    );
    assert!(t.occupancy()[0].0 <= 8, "host capacity respected");
    drop((m, t));

    // A restarted worker takes the same directory back. Damage every block on it: each is a
    // miss, recomputed, and the output is still right.
    let files: Vec<_> = std::fs::read_dir(dir.join("decode/0"))
        .expect("slot dir")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "kvb"))
        .collect();
    assert!(files.len() >= 12, "{} files", files.len());
    for f in &files {
        let mut b = std::fs::read(f).expect("read");
        let last = b.len() - 1;
        b[last] ^= 0x55;
        std::fs::write(f, b).expect("write");
    }
    // The slot is free once the old worker's offload thread has let go of it.
    let mut again = None;
    for _ in 0..100 {
        let m = native_worker(offload.clone(), 0x0f5).await;
        if m.tiers().expect("tiers").occupancy()[1].0 > 0 {
            again = Some(m);
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let m = again.expect("the restarted worker found its disk blocks");
    let t = m.tiers().expect("tiers").clone();
    assert_eq!(run(&m, &greedy(prompt(0), 6)).await, expected);
    assert!(stat(&t, |s| &s.corrupt) >= 1, "the damage was seen");
    assert_eq!(
        stat(&t, |s| &s.hits_disk),
        0,
        "nothing damaged was onboarded"
    );
}

#[test]
fn onboarded_blocks_are_byte_identical_to_the_offloaded_ones() {
    // What offload and onboarding do to a block on the native CPU backend: copy it out
    // (`save_blocks`, as at eviction), write the bytes into other blocks (`load_blocks`, as an
    // onboard), copy those out again. The exchanged layout (disaggregation) round-trips too.
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/tiny");
    let shape = dyn_compute::model::ModelConfig::load(&dir).expect("config");
    let weights = dyn_compute::model::Checkpoint::open(&dir)
        .and_then(|ck| {
            dyn_compute::model::ModelWeights::from_checkpoint(
                shape,
                &ck,
                dyn_compute::model::DType::F32,
            )
        })
        .expect("weights");
    let kv = dyn_compute::backend::KvShape {
        num_blocks: 6,
        block_size: 4,
    };
    let mut backend: Box<dyn dyn_compute::backend::Backend> =
        Box::new(dyn_compute::cpu::CpuBackend::with_threads(weights, kv, 1).expect("backend"));
    let tokens = prompt(3);
    backend
        .forward(&[dyn_compute::backend::SeqStep {
            tokens: &tokens[..8],
            start: 0,
            blocks: &[0, 1],
            logits: false,
            all_logits: false,
            hidden: false,
            lora: None,
        }])
        .expect("forward");
    let saved = backend.save_blocks(&[0, 1]).expect("save");
    assert!(saved[0].iter().any(|b| *b != 0), "the block holds KV");
    let data: Vec<&[u8]> = saved.iter().map(|b| b.as_slice()).collect();
    backend.load_blocks(&[3, 2], &data).expect("load");
    assert_eq!(backend.save_blocks(&[3, 2]).expect("save"), saved);
    let exchanged = backend.export_blocks(&[0, 1]).expect("export");
    assert_eq!(backend.export_blocks(&[3, 2]).expect("export"), exchanged);
    let data: Vec<&[u8]> = exchanged.iter().map(|b| b.as_slice()).collect();
    backend.import_blocks(&[5, 4], &data).expect("import");
    assert_eq!(backend.save_blocks(&[5, 4]).expect("save"), saved);
    // A payload of the wrong size is refused, not written.
    assert!(backend.load_blocks(&[4], &[&saved[0][1..]]).is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_pressure_blocks_are_dropped_not_waited_for_and_nothing_leaks() {
    let planes = Planes::embedded();
    let dir = dyn_tests::scratch_dir("offload-pressure");
    let config = mocker::MockerConfig {
        num_blocks: 64,
        block_size: 4,
        max_num_seqs: 16,
        speedup: 1e6,
        offload: OffloadConfig {
            host_blocks: 48,
            disk_dir: Some(dir.display().to_string()),
            disk_blocks: 96,
            // A few blocks at a time: most are dropped under this load.
            queue_blocks: 4,
            ..OffloadConfig::default()
        },
        ..mocker::MockerConfig::default()
    };
    let m = mocker::start(
        &config,
        &dyn_protocol::testing::cx("decode", 0x0f6, &[], &planes),
    )
    .await
    .expect("starts");
    let t = m.tiers().expect("tiers").clone();
    const REQUESTS: u32 = 10_000;
    let mut tasks = tokio::task::JoinSet::new();
    let mut done = 0u32;
    for i in 0..REQUESTS {
        // 40 shared prefixes of 3 blocks, then a tail of its own.
        let mut tokens: Vec<u32> = (0..12).map(|t| (i % 40) * 100 + t).collect();
        tokens.extend((0..(i % 9)).map(|t| 50_000 + i * 10 + t));
        let req = dyn_protocol::testing::preprocessed(tokens, 4 + i % 5);
        let m = m.clone();
        tasks.spawn(async move {
            let mut rx = loop {
                match m.submit(&req, None, None).await {
                    Ok(rx) => break rx,
                    Err(_) => tokio::time::sleep(Duration::from_millis(1)).await,
                }
            };
            if i % 7 == 0 {
                // Cancelled after its first token.
                let _ = rx.recv().await;
                return None;
            }
            let mut n = 0;
            while let Some(Ok(Generated::Tokens { ids, finish, .. })) = rx.recv().await {
                n += ids.len() as u32;
                if finish.is_some() {
                    return Some((n, 4 + i % 5));
                }
            }
            Some((n, u32::MAX))
        });
        while tasks.len() >= 64 {
            if let Some(r) = tasks.join_next().await {
                if let Some((got, want)) = r.expect("task") {
                    assert_eq!(got, want, "a finished request got all its tokens");
                }
                done += 1;
            }
        }
    }
    while let Some(r) = tasks.join_next().await {
        if let Some((got, want)) = r.expect("task") {
            assert_eq!(got, want);
        }
        done += 1;
    }
    assert_eq!(done, REQUESTS);
    until("the pool to drain", || m.gauges.active_blocks() == 0).await;
    let counts = t.counts();
    assert!(
        counts.dropped > 0,
        "the queue was full at times: {counts:?}"
    );
    assert!(counts.hits[0] > 0, "and still served hits: {counts:?}");
    let [(host, host_cap), (disk, disk_cap)] = counts.occupancy;
    assert!(host <= host_cap && disk <= disk_cap, "{counts:?}");
    assert_eq!(host, host_cap, "host memory is full at steady state");
    let files = std::fs::read_dir(dir.join("decode/0"))
        .expect("dir")
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "kvb"))
        .count();
    assert_eq!(files, disk, "one file per disk block, no leftovers");
    // Steady: another round of the same prefixes changes no count of blocks held.
    for i in 0..40 {
        let tokens: Vec<u32> = (0..12).map(|t| i * 100 + t).collect();
        run(&m, &dyn_protocol::testing::preprocessed(tokens, 2)).await;
    }
    until("the pool to drain", || m.gauges.active_blocks() == 0).await;
    let after = t.counts();
    assert_eq!(after.occupancy[0], counts.occupancy[0]);
    assert!(after.occupancy[1].0 <= disk_cap);
}

#[tokio::test]
async fn a_prompt_split_between_disk_and_host_memory_comes_back_whole() {
    // Its first blocks were evicted first, so they went on to disk; the later ones are still
    // in host memory. Reading the first ones must not push the later ones out.
    let planes = Planes::embedded();
    let dir = dyn_tests::scratch_dir("offload-split");
    let config = mocker::MockerConfig {
        num_blocks: 128,
        speedup: 100.0,
        offload: OffloadConfig {
            host_blocks: 128,
            disk_dir: Some(dir.display().to_string()),
            disk_blocks: 8192,
            ..OffloadConfig::default()
        },
        ..mocker::MockerConfig::default()
    };
    let m = mocker::start(
        &config,
        &dyn_protocol::testing::cx("decode", 0x0f9, &[], &planes),
    )
    .await
    .expect("starts");
    let t = m.tiers().expect("tiers").clone();
    let p = |i: u32| (0..1090).map(|x| i * 10_000 + x).collect::<Vec<u32>>();
    for i in 0..4 {
        run(&m, &dyn_protocol::testing::preprocessed(p(i), 2)).await;
    }
    until("the spill", || stat(&t, |s| &s.offloaded_disk) >= 17).await;
    let hashes: Vec<u64> = dyn_protocol::kv::block_hashes(&p(0), 16)
        .iter()
        .map(|b| b.block_hash)
        .collect();
    let layout: String = {
        let g = t.inner.lock();
        let disk = g.disk.as_ref().expect("disk");
        hashes
            .iter()
            .map(|h| match (g.host.contains(h), disk.contains(h)) {
                (true, _) => 'H',
                (_, true) => 'D',
                _ => '-',
            })
            .collect()
    };
    assert_eq!(layout, format!("{}{}", "D".repeat(17), "H".repeat(51)));
    run(&m, &dyn_protocol::testing::preprocessed(p(0), 2)).await;
    assert_eq!(t.counts().hits, [51, 17]);
}
