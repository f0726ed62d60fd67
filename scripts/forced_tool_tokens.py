"""Forced tool calls against one dyn server: REQUESTS chat requests with `tools`, alternately
`tool_choice: "required"` and a named function (`parallel_tool_calls: false`, temperature 0,
max_tokens MAX_TOKENS), one at a time. Per request: usage.completion_tokens, the finish
reason, whether the answer came back as a call whose arguments parse, and the call's own
length (the answer's text, from its `token_ids`, tokenized again by the server's `/tokenize`).
Prints one JSON line per request, then a summary line.

    python scripts/forced_tool_tokens.py URL MODEL [REQUESTS] [MAX_TOKENS]
"""

import json
import statistics
import sys
import time

import httpx
import openai

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 40},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The local time in a timezone.",
            "parameters": {
                "type": "object",
                "properties": {"timezone": {"type": "string", "maxLength": 40}},
                "required": ["timezone"],
                "additionalProperties": False,
            },
        },
    },
]

QUESTIONS = [
    "What's the weather like in Paris right now?",
    "Is it raining in Tokyo?",
    "How warm is it in Cairo today, in fahrenheit?",
    "Tell me the temperature in Oslo.",
    "Weather report for Buenos Aires, please.",
    "Do I need a coat in Toronto?",
    "What time is it in Sydney?",
    "Check the weather in Nairobi in celsius.",
    "Is it sunny in Lisbon?",
    "How cold is Moscow this morning?",
]


def main():
    url, model = sys.argv[1], sys.argv[2]
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 20
    max_tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 128
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=600)
    http = httpx.Client(base_url=url, timeout=60)
    rows = []
    for i in range(n):
        named = i % 2 == 1
        choice = (
            {"type": "function", "function": {"name": "get_weather"}} if named else "required"
        )
        started = time.monotonic()
        r = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": QUESTIONS[(i // 2) % len(QUESTIONS)]}],
            tools=TOOLS,
            tool_choice=choice,
            parallel_tool_calls=False,
            temperature=0,
            max_tokens=max_tokens,
            extra_body={"return_token_ids": True},
        )
        seconds = time.monotonic() - started
        c = r.choices[0]
        calls = c.message.tool_calls or []
        parsed = False
        if len(calls) == 1:
            try:
                json.loads(calls[0].function.arguments)
                parsed = calls[0].function.name in ("get_weather", "get_time")
            except (ValueError, TypeError):
                parsed = False
        # The call's own length: its text tokenized as the tokenizer does (the eos, where
        # the text shows it, left out).
        own = None
        ids = (c.model_extra or {}).get("token_ids")
        if ids:
            text = http.post("/detokenize", json={"model": model, "tokens": ids}).json()["prompt"]
            for end in ("<|im_end|>", "<|endoftext|>"):
                text = text.removesuffix(end)
            own = http.post(
                "/tokenize", json={"model": model, "prompt": text, "add_special_tokens": False}
            ).json()["count"]
        row = {
            "i": i,
            "tool_choice": "named" if named else "required",
            "completion_tokens": r.usage.completion_tokens,
            "own_length": own,
            "finish": c.finish_reason,
            "parsed": parsed,
            "seconds": round(seconds, 3),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    tokens = [r["completion_tokens"] for r in rows]
    own = [r["own_length"] for r in rows if r["own_length"] is not None]
    print(
        json.dumps(
            {
                "summary": True,
                "requests": n,
                "parsed": sum(r["parsed"] for r in rows),
                "cut": sum(r["finish"] == "length" for r in rows),
                "tokens_mean": round(statistics.mean(tokens), 1),
                "tokens_min": min(tokens),
                "tokens_max": max(tokens),
                "own_mean": round(statistics.mean(own), 1) if own else None,
                "seconds_mean": round(statistics.mean(r["seconds"] for r in rows), 3),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
