//! Preemption of structured outputs that fast-forward, on the scheduler alone: a forced tool
//! call's tokens are appended after the sampled one without KV, so a sequence preempted right
//! after such a step has a run of tokens to compute again besides its prompt, and one that
//! `max_tokens` cuts must stop inside a forced run even when it is recomputed. A step
//! "samples" deterministically under each grammar's mask, so the outputs of a roomy pool and
//! of pools small enough to preempt must be the same tokens.

use std::collections::BTreeMap;
use std::sync::Arc;

use dyn_llm::grammar::{Compiled, Grammars};
use dyn_llm::model::ModelDir;

use super::*;

/// The repository's tiny model, with the forced Hermes call of `get_weather` compiled: only
/// the city's first token is the "model's" choice, everything else is forced.
struct Tiny {
    m: ModelDir,
    grammars: Arc<Grammars>,
    call: Compiled,
}

fn tiny() -> Tiny {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../models/tiny");
    let m = ModelDir::load("tiny", std::path::Path::new(dir)).expect("tokenizer");
    let grammars = m.grammars().expect("grammar vocabulary");
    let call = dyn_protocol::testing::weather_call(serde_json::json!({"enum": ["Paris", "Tokyo"]}));
    let call = grammars.compile_here(&call).expect("compiles");
    Tiny { m, grammars, call }
}

impl Tiny {
    /// A sequence forced to the call, with a guide of its own (a guide is the state of one
    /// output: every run needs new ones).
    fn spec(&self, prompt: Vec<u32>, seed: u64, max_tokens: u32) -> SeqSpec {
        let guide = self.grammars.guide(&self.call, Vec::new(), max_tokens);
        SeqSpec {
            stop_tokens: self.m.eos_token_ids.clone().into(),
            sampling: dyn_compute::sample::SamplingParams {
                seed,
                ..Default::default()
            },
            guide: Some(Arc::new(parking_lot::Mutex::new(guide))),
            ..super::tests::spec(prompt, max_tokens)
        }
    }

    /// The token a step samples for `w`, as an engine does: under the grammar's mask, which
    /// then takes it (and computes the run it forces next). eos where the call is complete,
    /// else [`token_at`] among the allowed tokens, so the choice depends on the seed and the
    /// position only, never on the step it falls in.
    fn pick(&self, w: &Work<'_>) -> u32 {
        let mut g = w.spec.guide.as_ref().expect("guided").lock();
        let mask = g.mask(self.m.vocab_size as usize);
        let token = match self.m.eos_token_ids.iter().find(|&&e| mask.is_allowed(e)) {
            Some(&eos) => eos,
            None => {
                let allowed: Vec<u32> = (0..self.m.vocab_size)
                    .filter(|&t| mask.is_allowed(t))
                    .collect();
                token_at(w.spec, &allowed, w.spec.offset + w.generated)
            }
        };
        g.commit(token);
        token
    }

    /// The tokens of the call up to the city: the first sampled token and the run forced
    /// after it.
    fn first_run(&self) -> usize {
        let mut g = self.grammars.guide(&self.call, Vec::new(), 1000);
        let mask = g.mask(self.m.vocab_size as usize);
        let first = (0..self.m.vocab_size)
            .find(|&t| mask.is_allowed(t))
            .expect("a first token");
        g.commit(first);
        1 + g.take_forced().len()
    }

    /// The call in `ids` (eos left out), parsed: its city.
    fn city(&self, ids: &[u32]) -> String {
        let ids: Vec<u32> = ids
            .iter()
            .copied()
            .filter(|t| !self.m.eos_token_ids.contains(t))
            .collect();
        crate::fast_forward_tests::called_city(
            &self.m.tokenizer.decode(&ids, false).expect("decodes"),
        )
    }
}

/// What one run came to.
#[derive(Debug, Default)]
struct Run {
    /// Each sequence's tokens and finish.
    out: BTreeMap<SeqId, Vec<u32>>,
    finish: BTreeMap<SeqId, FinishReason>,
    preemptions: u64,
    /// Preemptions of a sequence that held a forced run without KV (appended by the step
    /// before, or not yet computed whole): (step, sequence, tokens it held without KV).
    forced_preempted: Vec<(usize, SeqId, usize)>,
    /// The step each sequence finished in, and how many tokens that step gave it.
    last_step: BTreeMap<SeqId, (usize, usize)>,
}

/// Three calls of distinct prompts and seeds: the third's `max_tokens` ends it two tokens into
/// the run forced after its city (`cut`), the only token it samples but the first.
fn specs(t: &Tiny, cut: u32) -> Vec<(SeqId, SeqSpec)> {
    vec![
        (1, t.spec((10..15).collect(), 1, 200)),
        (2, t.spec((20..26).collect(), 2, 200)),
        (3, t.spec((30..37).collect(), 3, cut)),
    ]
}

/// The calls of [`specs`] through a scheduler of `num_blocks` blocks of 4 tokens and a token
/// budget of `budget` a step (the batch has room for all three).
fn run(t: &Tiny, cut: u32, num_blocks: u32, budget: usize) -> Run {
    let mut s = Scheduler::new(
        Limits {
            block_size: 4,
            max_num_seqs: 8,
            max_num_batched_tokens: budget,
        },
        num_blocks,
    );
    for (id, spec) in specs(t, cut) {
        s.add(id, spec);
    }
    let mut r = Run::default();
    for step in 0..1000 {
        if s.is_idle() {
            assert_eq!(s.pool.active(), 0, "a finished run holds no block");
            r.preemptions = s.counters.preemptions;
            return r;
        }
        // Tokens each running sequence holds without KV before the step, and its preemptions:
        // more than one such token is a forced run (the sampled token alone is one).
        let before: BTreeMap<SeqId, (usize, u32)> = s
            .running
            .iter()
            .map(|q| (q.id, (q.tokens.len() - q.computed, q.preemptions)))
            .collect();
        let out = s
            .step(|work, _| {
                Ok(work
                    .iter()
                    .filter(|w| w.sample)
                    .map(|w| t.pick(w))
                    .collect())
            })
            .expect("a step");
        assert!(out.ended.is_empty(), "the pool holds any one call");
        for q in &s.waiting {
            if let Some(&(pending, preemptions)) = before.get(&q.id)
                && q.preemptions > preemptions
                && pending > 1
            {
                r.forced_preempted.push((step, q.id, pending));
            }
        }
        let mut given = BTreeMap::<SeqId, usize>::new();
        for (id, token, finish) in out.tokens {
            r.out.entry(id).or_default().push(token);
            *given.entry(id).or_default() += 1;
            if let Some(f) = finish {
                assert!(r.finish.insert(id, f).is_none(), "{id} finished twice");
                r.last_step.insert(id, (step, given[&id]));
            }
        }
    }
    panic!("the scheduler did not finish");
}

#[test]
fn preempting_forced_calls_before_their_runs_are_computed_changes_no_output_and_leaks_no_block() {
    let t = tiny();
    // The call's opening up to the city, forced after its first token.
    let first = t.first_run();
    assert!(first > 8, "{first} tokens");
    let cut = first as u32 + 3;
    let roomy = run(&t, cut, 256, 256);
    assert_eq!(roomy.preemptions, 0);
    let specs = specs(&t, cut);
    for (id, spec) in &specs {
        let out = &roomy.out[id];
        assert!(out.len() <= spec.max_tokens as usize, "{id}: {}", out.len());
        if *id == 3 {
            // Exactly its budget, the last step giving it the city and two forced tokens.
            assert_eq!(out.len(), cut as usize);
            assert_eq!(roomy.finish[id], FinishReason::Length);
            assert_eq!(roomy.last_step[id].1, 3);
        } else {
            assert!(["Paris", "Tokyo"].contains(&t.city(out).as_str()));
            assert_eq!(roomy.finish[id], FinishReason::Stop);
        }
    }

    // Every pool from the smallest that holds the longest call alone (its last token needs no
    // slot) to one that holds all three, with the forced runs computed whole or in chunks of a
    // small token budget: the same tokens and finishes, and no block left (`run` checks).
    let blocks = |id: SeqId| {
        let tokens = specs[id as usize - 1].1.prompt.len() + roomy.out[&id].len();
        (tokens - 1).div_ceil(4) as u32
    };
    let smallest = (1..=3).map(blocks).max().expect("three");
    let all = (1..=3).map(blocks).sum::<u32>();
    let mut after_the_city = false;
    for budget in [256, 16] {
        for num_blocks in smallest..=all {
            let tight = run(&t, cut, num_blocks, budget);
            let case = format!("{num_blocks} blocks, {budget} tokens a step");
            assert_eq!(tight.out, roomy.out, "{case}");
            assert_eq!(tight.finish, roomy.finish, "{case}");
            after_the_city |= tight
                .forced_preempted
                .iter()
                .any(|&(_, _, pending)| pending < first);
            if num_blocks != smallest || budget != 256 {
                continue;
            }
            // The smallest pool preempts the cut call (the newest) in the step after its
            // first one, its opening not computed yet; recomputed, it is still cut by its
            // budget, in the run forced after its city.
            assert!(tight.preemptions > 0);
            let (step, _, pending) = *tight
                .forced_preempted
                .iter()
                .find(|p| p.1 == 3)
                .unwrap_or_else(|| panic!("{case}: {:?}", tight.forced_preempted));
            assert_eq!((step, pending), (1, first), "{case}");
            let (last, given) = tight.last_step[&3];
            assert!(last > step + 1 && given == 3, "{case}: {last}, {given}");
        }
    }
    assert!(
        after_the_city,
        "some pool preempts a call holding its closing run"
    );
}
