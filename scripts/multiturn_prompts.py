#!/usr/bin/env python3
"""Multi-turn chat prompts for `dyn bench --prompts`: CONVERSATIONS conversations of TURNS turns,
each turn re-sending the whole history (earlier user turns and assistant replies) plus a new
user message of about WORDS words. Lines go round-robin over the conversations (turn 1 of
each, then turn 2 of each, ...), so with a closed loop of one request the whole working set
cycles through a worker's cache between two turns of one conversation.

  scripts/multiturn_prompts.py CONVERSATIONS TURNS WORDS REPLY_WORDS > prompts.jsonl
"""
import json
import random
import sys

conversations, turns, words, reply_words = (int(a) for a in sys.argv[1:5])
vocab = ("time year people way day man thing woman life child world school state family "
         "student group country problem hand part place case week company system program "
         "question work government number night point home water room mother area money "
         "story fact month lot right study book eye job word business issue side kind head "
         "house service friend father power hour game line end member law car city name").split()


def text(rng, n):
    return " ".join(rng.choice(vocab) for _ in range(n))


histories = []
for c in range(conversations):
    rng = random.Random(c)
    histories.append((rng, [{"role": "system", "content": f"You are assistant number {c}."}]))
for t in range(turns):
    for c in range(conversations):
        rng, history = histories[c]
        history.append({"role": "user", "content": text(rng, words)})
        print(json.dumps(history))
        history.append({"role": "assistant", "content": text(rng, reply_words)})
