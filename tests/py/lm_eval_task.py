"""A small local multiple-choice task for the official `lm_eval` harness, so that it can run
against a dyn graph without a data set from the Hub: a JSONL file of questions and the task's
YAML, which loads it with the `json` dataset builder.

Usage: lm_eval_task.py DIR. Writes DIR/dyn_mc.jsonl and DIR/dyn_mc.yaml (task `dyn_mc`, pass
`--include_path DIR`) and prints the number of questions. The questions are the same on
every run: they are listed below, not drawn.

Each question is answered by loglikelihood: `Question: …\\nAnswer:` followed by each choice
after a space; the choice the model finds likeliest is its answer (`acc`).
"""
import json
import os
import sys

CAPITALS = [
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
    ("Japan", "Tokyo"), ("Russia", "Moscow"), ("Egypt", "Cairo"), ("Greece", "Athens"),
    ("Portugal", "Lisbon"), ("Ireland", "Dublin"), ("Norway", "Oslo"), ("Austria", "Vienna"),
]
OPPOSITES = [
    ("hot", "cold"), ("up", "down"), ("big", "small"), ("day", "night"), ("fast", "slow"),
    ("open", "closed"), ("happy", "sad"), ("early", "late"),
]
ANIMALS = [
    ("dog", "bark"), ("cat", "meow"), ("cow", "moo"), ("duck", "quack"), ("sheep", "baa"),
    ("lion", "roar"),
]


def questions():
    """(question, choices, index of the right choice), in a fixed order: the right answer's
    place rotates so that a model preferring one position gains nothing."""
    out = []
    for i, (country, city) in enumerate(CAPITALS):
        others = [c for _, c in CAPITALS if c != city][i % 4 : i % 4 + 3]
        out.append((f"What is the capital of {country}?", city, others))
    for i, (word, opposite) in enumerate(OPPOSITES):
        others = [o for _, o in OPPOSITES if o != opposite][i % 3 : i % 3 + 3]
        out.append((f"What is the opposite of {word}?", opposite, others))
    for i, (a, b) in enumerate([(2, 3), (4, 4), (1, 6), (5, 2), (3, 3), (7, 1), (6, 2), (2, 2)]):
        right = a + b
        out.append((f"What is {a} plus {b}?", str(right), [str(right + d) for d in (1, 2, -1)]))
    for i, (animal, sound) in enumerate(ANIMALS):
        others = [s for _, s in ANIMALS if s != sound][i % 2 : i % 2 + 3]
        out.append((f"What sound does a {animal} make?", sound, others))
    docs = []
    for i, (q, right, others) in enumerate(out):
        at = i % 4
        choices = others[:at] + [right] + others[at:]
        docs.append({"question": q, "choices": choices, "answer": at})
    return docs


YAML = """\
task: dyn_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    data = os.path.abspath(os.path.join(out, "dyn_mc.jsonl"))
    docs = questions()
    with open(data, "w") as f:
        for d in docs:
            assert len(d["choices"]) == 4 and len(set(d["choices"])) == 4, d
            f.write(json.dumps(d) + "\n")
    with open(os.path.join(out, "dyn_mc.yaml"), "w") as f:
        f.write(YAML.format(data=json.dumps(data)))
    print(len(docs))


if __name__ == "__main__":
    main()
