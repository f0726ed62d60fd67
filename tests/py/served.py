"""What the client scripts share: a streamed chat answer's models and whether it had text, what
the client raises for a model that is not served (lora.py, models.py), and the weather tool's
arguments schema (structured.py, responses.py, anthropic_messages.py)."""
import json

import openai

# A tool's arguments, bounded so that a small model's forced call ends.
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}


def streamed_chat(client, model, content, max_tokens):
    """Print the models a streamed chat answer names and whether it carried text."""
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": content}],
        max_tokens=max_tokens,
        stream=True,
    )
    models, text = set(), []
    for chunk in stream:
        models.add(chunk.model)
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
    print(json.dumps({"models": sorted(models), "text": bool("".join(text))}))


def not_served(client, model):
    """Print the error the client raises for `model`."""
    try:
        client.completions.create(model=model, prompt="hi", max_tokens=1)
        print(json.dumps({"error": None}))
    except openai.NotFoundError as e:
        print(json.dumps({"error": "NotFoundError", "status": e.status_code}))
