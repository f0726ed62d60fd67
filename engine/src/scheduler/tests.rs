//! The scheduler on the mocker's deterministic tokens: outputs, caching, limits, preemption,
//! prefill and import.

use super::*;

const VOCAB: std::ops::Range<u32> = 0..1000;

fn vocab() -> Vec<u32> {
    VOCAB.collect()
}

pub(super) fn spec(prompt: Vec<u32>, max_tokens: u32) -> SeqSpec {
    SeqSpec {
        offset: 0,
        prompt,
        max_tokens,
        stop_tokens: Vec::new().into(),
        min_tokens: 0,
        sampling: dyn_compute::sample::SamplingParams {
            seed: 42,
            ..Default::default()
        },
        penalties: None,
        logprobs: None,
        prompt_logprobs: None,
        guide: None,
        role: SeqRole::Full,
        precedence: Precedence::default(),
        salt: None,
        hashes: Default::default(),
        lora: None,
        embed: None,
    }
}

/// A step with the mocker's output.
fn step(s: &mut Scheduler) -> StepOutcome {
    let v = vocab();
    s.step(|work, _| {
        Ok(work
            .iter()
            .filter(|w| w.sample)
            .map(|w| token_at(w.spec, &v, w.spec.offset + w.generated))
            .collect())
    })
    .unwrap()
}

fn limits(max_num_seqs: usize, max_num_batched_tokens: usize) -> Limits {
    Limits {
        block_size: 4,
        max_num_seqs,
        max_num_batched_tokens,
    }
}

/// Step until idle; the tokens each sequence got, in order.
fn drain(s: &mut Scheduler) -> std::collections::BTreeMap<SeqId, Vec<u32>> {
    let mut out = std::collections::BTreeMap::<SeqId, Vec<u32>>::new();
    for _ in 0..10_000 {
        if s.is_idle() {
            return out;
        }
        for (id, t, _) in step(s).tokens {
            out.entry(id).or_default().push(t);
        }
    }
    panic!("scheduler did not finish");
}

#[test]
fn output_is_deterministic_and_depends_on_the_seed() {
    let a = spec(vec![1, 2, 3], 5);
    let toks: Vec<u32> = (0..5).map(|i| token_at(&a, &vocab(), i)).collect();
    let mut s = Scheduler::new(limits(8, 64), 16);
    s.add(1, a.clone());
    assert_eq!(drain(&mut s)[&1], toks);
    let b = SeqSpec {
        sampling: dyn_compute::sample::SamplingParams {
            seed: 43,
            ..a.sampling
        },
        ..a
    };
    assert_ne!(
        (0..5)
            .map(|i| token_at(&b, &vocab(), i))
            .collect::<Vec<_>>(),
        toks
    );
}

#[test]
fn output_comes_from_the_given_vocabulary() {
    let s = spec(vec![1], 1);
    assert!((0..100).all(|i| [7, 9].contains(&token_at(&s, &[7, 9], i))));
}

#[test]
fn a_stop_token_ends_the_output_once_min_tokens_are_out() {
    // Every token is 7 and 7 stops: the first ends it, unless min_tokens holds it open.
    let run = |min_tokens| {
        let mut s = Scheduler::new(limits(8, 64), 16);
        s.add(
            1,
            SeqSpec {
                stop_tokens: vec![7].into(),
                min_tokens,
                ..spec(vec![1, 2], 10)
            },
        );
        let mut got = Vec::new();
        while !s.is_idle() {
            let out = s
                .step(|w, _| Ok(w.iter().filter(|w| w.sample).map(|_| 7).collect()))
                .unwrap();
            got.extend(out.tokens.into_iter().map(|(_, _, f)| f));
        }
        got
    };
    assert_eq!(run(0), [Some(FinishReason::Stop)]);
    assert_eq!(run(2), [None, None, Some(FinishReason::Stop)]);
}

#[test]
fn a_failed_step_advances_nothing_and_names_its_sequences() {
    let mut s = Scheduler::new(limits(8, 64), 16);
    s.add(1, spec(vec![1, 2, 3], 4));
    let boom = || EngineError::Internal("boom".into());
    let (e, ids) = s.step(|_, _| Err(boom())).unwrap_err();
    assert_eq!((e.to_string(), ids), ("boom".into(), vec![1]));
    let (e, _) = s.step(|_, _| Ok(vec![])).unwrap_err();
    assert!(e.to_string().contains("sampled 0 tokens for 1"), "{e}");
    // Still in the batch with nothing computed: a good step runs it from the start.
    assert_eq!(step(&mut s).prefill_tokens, 3);
}

#[test]
fn a_repeated_prompt_reuses_its_cached_prefix() {
    let mut s = Scheduler::new(limits(8, 64), 16);
    let prompt: Vec<u32> = (0..10).collect(); // two full blocks of 4, and 2 tokens
    s.add(1, spec(prompt.clone(), 2));
    drain(&mut s);
    s.add(2, spec(prompt, 2));
    let first = step(&mut s);
    // Only the 2 tokens of the partial block are computed again.
    assert_eq!(first.prefill_tokens, 2);
    assert_eq!(
        (s.counters.prompt_blocks, s.counters.prompt_blocks_hit),
        (4, 2)
    );
}

#[test]
fn a_salted_prompt_hits_only_blocks_cached_under_its_own_salt() {
    use dyn_protocol::kv::{KvEventData, block_hashes, block_hashes_salted, salt_hash};
    let mut s = Scheduler::new(limits(8, 64), 16);
    let prompt: Vec<u32> = (0..10).collect(); // two full blocks of 4, and 2 tokens
    let mut next = 0;
    // Run the prompt with `salt`; the prompt blocks it found cached, and the blocks it stored.
    let mut run = |salt: Option<&str>| {
        next += 1;
        let before = s.counters.prompt_blocks_hit;
        s.add(
            next,
            SeqSpec {
                salt: salt.map(salt_hash),
                ..spec(prompt.clone(), 2)
            },
        );
        drain(&mut s);
        let stored: Vec<(Option<u64>, Vec<dyn_protocol::kv::BlockHash>)> = s
            .pool
            .take_events()
            .into_iter()
            .filter_map(|e| match e {
                KvEventData::Stored {
                    parent_hash,
                    blocks,
                } => Some((parent_hash, blocks)),
                _ => None,
            })
            .collect();
        (s.counters.prompt_blocks_hit - before, stored)
    };
    let (hit, stored) = run(Some("a"));
    assert_eq!(hit, 0);
    // Its events name the salted blocks, a chain from the root, as routers hash them.
    let salted = block_hashes_salted(&prompt[..8], 4, Some(salt_hash("a")));
    assert_eq!(stored[0].0, None);
    assert_eq!(stored[0].1[..2], salted[..]);
    assert_ne!(salted, block_hashes(&prompt[..8], 4));
    // Another salt, or none, finds nothing; the same salt finds both blocks.
    assert_eq!(run(Some("b")).0, 0);
    let (hit, stored) = run(None);
    assert_eq!(hit, 0);
    assert_eq!(stored[0].1[..2], block_hashes(&prompt[..8], 4)[..]);
    assert_eq!(run(Some("a")).0, 2);
    assert_eq!(run(None).0, 2);
}

#[test]
fn long_prompts_are_prefilled_in_chunks() {
    let mut s = Scheduler::new(limits(8, 8), 16);
    s.add(1, spec((0..20).collect(), 1));
    let steps: Vec<usize> = (0..3).map(|_| step(&mut s).prefill_tokens).collect();
    assert_eq!(steps, vec![8, 8, 4]);
    assert!(s.is_idle());
}

#[test]
fn batch_limits_hold() {
    let mut s = Scheduler::new(limits(2, 64), 64);
    for id in 0..5 {
        s.add(id, spec(vec![1, 2, 3], 3));
    }
    step(&mut s);
    assert_eq!((s.running(), s.waiting()), (2, 3));
    let mut s = Scheduler::new(limits(8, 6), 64);
    for id in 0..3 {
        s.add(id, spec(vec![1, 2, 3], 3));
    }
    let first = step(&mut s);
    assert_eq!(first.prefill_tokens, 6, "token budget caps the step");
    assert_eq!(s.running(), 2);
}

#[test]
fn running_out_of_blocks_preempts_the_newest_and_output_is_unchanged() {
    // 4 blocks of 4 tokens; two sequences that each grow to 3 blocks cannot both fit.
    let mut s = Scheduler::new(limits(8, 64), 4);
    s.add(1, spec(vec![1, 2, 3], 8));
    s.add(2, spec(vec![4, 5, 6], 8));
    let got = drain(&mut s);
    assert!(s.counters.preemptions > 0);
    for (id, prompt) in [(1, vec![1, 2, 3]), (2, vec![4, 5, 6])] {
        let sp = spec(prompt, 8);
        assert_eq!(
            got[&id],
            (0..8)
                .map(|i| token_at(&sp, &vocab(), i))
                .collect::<Vec<_>>()
        );
    }
    assert_eq!(s.pool.active(), 0);
}

#[test]
fn a_sequence_larger_than_the_cache_ends_instead_of_preempting_itself_forever() {
    // 2 blocks of 4 tokens: a 3-token prompt can grow to 8 tokens and no further.
    let mut s = Scheduler::new(limits(8, 64), 2);
    s.add(1, spec(vec![1, 2, 3], 100));
    let mut got = 0;
    for _ in 0..100 {
        let out = step(&mut s);
        got += out.tokens.len();
        if out.ended == [1] {
            assert!(s.is_idle());
            assert_eq!(s.pool.active(), 0);
            assert_eq!(
                got, 6,
                "tokens until the cache was full (the last needs no slot)"
            );
            return;
        }
    }
    panic!("the sequence never ended");
}

#[test]
fn removing_a_sequence_frees_its_blocks() {
    let mut s = Scheduler::new(limits(8, 64), 16);
    s.add(1, spec((0..10).collect(), 100));
    step(&mut s);
    assert!(s.pool.active() > 0);
    assert!(s.remove(1));
    assert_eq!(s.pool.active(), 0);
    assert!(!s.remove(1));
}

#[test]
fn prefill_then_import_gives_the_aggregated_output_and_moves_the_blocks() {
    let prompt: Vec<u32> = (0..10).collect();
    let full = spec(prompt.clone(), 4);
    let expected: Vec<u32> = (0..4).map(|i| token_at(&full, &vocab(), i)).collect();

    // Prefill worker: one token, and the prompt's 3 blocks (of 4 tokens) stay pinned.
    let mut p = Scheduler::new(limits(8, 64), 16);
    p.add(
        1,
        SeqSpec {
            role: SeqRole::Prefill,
            ..full.clone()
        },
    );
    let out = step(&mut p);
    assert_eq!(
        out.tokens,
        vec![(1, expected[0], Some(FinishReason::Length))]
    );
    let [(1, blocks, tokens)] = out.pinned.as_slice() else {
        panic!("one pinned sequence: {:?}", out.pinned);
    };
    assert_eq!((blocks.len(), tokens.as_slice()), (3, prompt.as_slice()));
    assert!(p.is_idle());
    assert_eq!(p.pool.active(), 3, "pinned until released");
    for b in blocks {
        p.pool.release(*b);
    }
    assert_eq!(p.pool.active(), 0);

    // Decode worker: admitted with the prompt computed, no prefill work, same output.
    let mut d = Scheduler::new(limits(8, 64), 16);
    d.add(
        2,
        SeqSpec {
            role: SeqRole::Imported {
                first_token: expected[0],
            },
            ..full
        },
    );
    let first = step(&mut d);
    assert_eq!(first.prefill_tokens, 0);
    assert_eq!(first.tokens, vec![(2, expected[0], None)]);
    let mut got = vec![expected[0]];
    got.extend(drain(&mut d)[&2].iter().copied());
    assert_eq!(got, expected);
}

#[test]
fn a_preempted_import_recomputes_its_prompt() {
    let mut s = Scheduler::new(limits(8, 64), 4);
    s.add(1, spec(vec![1, 2, 3], 8));
    s.add(
        2,
        SeqSpec {
            role: SeqRole::Imported { first_token: 7 },
            ..spec(vec![4, 5, 6], 8)
        },
    );
    let got = drain(&mut s);
    assert!(s.counters.preemptions > 0);
    let sp = spec(vec![4, 5, 6], 8);
    assert_eq!(got[&2][0], 7);
    assert_eq!(
        got[&2][1..],
        (1..8)
            .map(|i| token_at(&sp, &vocab(), i))
            .collect::<Vec<_>>()[..]
    );
}

fn ranked(prompt: Vec<u32>, max_tokens: u32, priority: i32, yields: bool) -> SeqSpec {
    SeqSpec {
        precedence: Precedence { priority, yields },
        ..spec(prompt, max_tokens)
    }
}

#[test]
fn a_full_batch_makes_way_for_a_request_that_comes_first() {
    let mut got = std::collections::BTreeMap::<SeqId, Vec<u32>>::new();
    let mut run = |s: &mut Scheduler| {
        let out = step(s);
        for (id, t, _) in &out.tokens {
            got.entry(*id).or_default().push(*t);
        }
        out
    };
    // Two places, both taken by batch requests (priority 1) in decode.
    let mut s = Scheduler::new(limits(2, 64), 64);
    s.add(1, ranked(vec![1, 2, 3], 20, 1, false));
    s.add(2, ranked(vec![4, 5, 6], 20, 1, false));
    run(&mut s);
    run(&mut s);
    assert_eq!(s.running(), 2);
    // An equal does not preempt: it waits.
    s.add(3, ranked(vec![7, 8, 9], 2, 1, false));
    let out = run(&mut s);
    assert_eq!((out.preempted, s.running(), s.waiting()), (0, 2, 1));
    // An interactive one (priority 0) goes ahead of the waiting one and takes the newest
    // batch request's place in the same step.
    s.add(4, ranked(vec![10, 11, 12], 2, 0, false));
    let out = run(&mut s);
    assert_eq!(out.preempted, 1);
    assert!(
        out.tokens.iter().any(|(id, _, _)| *id == 4),
        "it starts at once"
    );
    assert!(
        out.tokens.iter().all(|(id, _, _)| *id != 2),
        "the newest batch one gave way"
    );
    while !s.is_idle() {
        run(&mut s);
    }
    // Everyone finishes, the preempted one with the tokens it would have had alone.
    let alone = spec(vec![4, 5, 6], 20);
    let want: Vec<u32> = (0..20).map(|i| token_at(&alone, &vocab(), i)).collect();
    assert_eq!(got[&2], want);
    assert_eq!((got[&3].len(), got[&4].len()), (2, 2));
}

#[test]
fn within_a_priority_a_request_that_yields_gives_way_to_one_that_does_not() {
    let mut s = Scheduler::new(limits(2, 64), 64);
    s.add(1, ranked(vec![1, 2, 3], 20, 0, false));
    s.add(2, ranked(vec![4, 5, 6], 20, 0, true));
    step(&mut s);
    // A yielding newcomer waits; one that does not yield takes the yielding one's place.
    s.add(3, ranked(vec![7, 8, 9], 4, 0, true));
    assert_eq!(step(&mut s).preempted, 0);
    s.add(4, ranked(vec![10, 11, 12], 4, 0, false));
    let out = step(&mut s);
    assert_eq!(out.preempted, 1);
    assert!(out.tokens.iter().any(|(id, _, _)| *id == 4));
    assert!(
        out.tokens.iter().any(|(id, _, _)| *id == 1),
        "the other keeps its place"
    );
    // The preempted one waits ahead of the later yielding one.
    let order: Vec<SeqId> = s.waiting.iter().map(|q| q.id).collect();
    assert_eq!(order, [2, 3]);
    drain(&mut s);
}

#[test]
fn sequences_of_one_adapter_run_side_by_side_and_keep_their_own_tokens() {
    use dyn_compute::model::lora::LoraAdapter;
    let models = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models");
    let c = dyn_compute::model::ModelConfig::load(&models.join("tiny")).unwrap();
    let load = |n: &str| {
        std::sync::Arc::new(LoraAdapter::load(&models.join("tiny-lora").join(n), &c).unwrap())
    };
    let (qv, all) = (load("qv"), load("all"));
    let with = |prompt: Vec<u32>, lora: &Option<std::sync::Arc<LoraAdapter>>| SeqSpec {
        lora: lora.clone(),
        ..spec(prompt, 6)
    };
    let loras = [
        Some(qv.clone()),
        None,
        Some(all.clone()),
        Some(qv.clone()),
        None,
    ];
    let mut s = Scheduler::new(limits(8, 64), 64);
    for (i, l) in loras.iter().enumerate() {
        s.add(i as SeqId + 1, with(vec![i as u32 + 1, 7, 8], l));
    }
    let v = vocab();
    let mut got = std::collections::BTreeMap::<SeqId, Vec<u32>>::new();
    while !s.is_idle() {
        let out = s
            .step(|work, _| {
                let ids: Vec<Option<u64>> = work
                    .iter()
                    .map(|w| w.spec.lora.as_ref().map(|a| a.id))
                    .collect();
                let mut sorted = ids.clone();
                sorted.sort();
                assert_eq!(ids, sorted, "adapters side by side, the base first");
                Ok(work
                    .iter()
                    .filter(|w| w.sample)
                    .map(|w| token_at(w.spec, &v, w.spec.offset + w.generated))
                    .collect())
            })
            .unwrap();
        for (id, t, _) in out.tokens {
            got.entry(id).or_default().push(t);
        }
    }
    // Each got its own tokens, whatever place the order gave it.
    for (i, l) in loras.iter().enumerate() {
        let alone = with(vec![i as u32 + 1, 7, 8], l);
        let want: Vec<u32> = (0..6).map(|k| token_at(&alone, &v, k)).collect();
        assert_eq!(got[&(i as SeqId + 1)], want, "sequence {}", i + 1);
    }
}
