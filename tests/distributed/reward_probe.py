"""A Python reward for the multi-process tests (imported by `jaxrl` processes through
`data.reward_fn=tests.distributed.reward_probe:own_answer`): it scores a completion, checks
that the answer field handed to it belongs to its prompt, and logs, per call, which process
scored how many samples to $JAXRL_REWARD_PROBE_DIR/<pid>.jsonl."""

import json
import os


def own_answer(prompt: str, completion: str, fields: dict) -> float:
    a, b = (int(w) for w in prompt.split() if w.isdigit())
    matched = fields["answer"] == str(a + b)
    with open(os.path.join(os.environ["JAXRL_REWARD_PROBE_DIR"], f"{os.getpid()}.jsonl"),
              "a", encoding="utf-8") as f:
        f.write(json.dumps({"matched": matched}) + "\n")
    # Varies with the completion, so groups differ and the policy is updated.
    return float(matched) * (sum(map(ord, completion)) % 5) / 4
