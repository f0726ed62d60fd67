#!/usr/bin/env python3
"""Long conversations against an OpenAI-compatible server, as a stateless chat API sees an
agent: every turn resends the whole history plus one new user message, and asks for one token.

Usage: [SEED=N] conversation_load.py PORT CONVERSATIONS TURNS WORDS PID...

CONVERSATIONS conversations of TURNS turns run interleaved (turn t of every conversation, then
turn t + 1), so a server's cache of one conversation sees the others in between. Each turn adds
a user message and, after the answer, an assistant message of WORDS words each (seeded text:
the same for the same SEED, new conversations for another). The server's CPU (user + system of the PIDs' process trees, from
/proc) is read before the last half of the turns and after them; one JSON line goes to stdout:
CPU per turn over the last half, the last turn's prompt tokens, and any failures.
"""

import http.client
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from proc_cpu import tree_cpu  # noqa: E402


def main():
    port, convs, turns, words = (int(a) for a in sys.argv[1:5])
    pids = [int(p) for p in sys.argv[5:]]
    rng = random.Random(7)
    vocab = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
        for _ in range(2000)
    ]
    rng = random.Random(int(os.environ.get("SEED", "1")))

    def text(n):
        return " ".join(rng.choice(vocab) for _ in range(n)) + "."

    histories = [[{"role": "system", "content": "You are a careful assistant. " + text(40)}]
                 for _ in range(convs)]
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    failed, last_prompt, cpu0, t0 = 0, 0, None, None
    for turn in range(turns):
        if turn == turns // 2:
            cpu0, t0 = tree_cpu(pids), time.monotonic()
        for h in histories:
            h.append({"role": "user", "content": text(words)})
            body = json.dumps({"model": "tiny", "messages": h, "max_tokens": 1,
                               "temperature": 0})
            conn.request("POST", "/v1/chat/completions", body,
                         {"content-type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
            if resp.status != 200:
                failed += 1
                print(f"turn {turn}: HTTP {resp.status}: {data[:300]!r}", file=sys.stderr)
            else:
                last_prompt = json.loads(data)["usage"]["prompt_tokens"]
            h.append({"role": "assistant", "content": text(words)})
    cpu1, t1 = tree_cpu(pids), time.monotonic()
    measured = convs * (turns - turns // 2)
    print(json.dumps({
        "turns_measured": measured,
        "cpu_ms_per_turn": (cpu1 - cpu0) * 1e3 / measured,
        "wall_ms_per_turn": (t1 - t0) * 1e3 / measured,
        "last_prompt_tokens": last_prompt,
        "failed": failed,
    }))


if __name__ == "__main__":
    main()
