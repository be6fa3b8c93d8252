"""lm-evaluation-harness against the server (issue 14, item 5): its `local-completions` model
runs a small local multiple-choice task (log-likelihood requests: echo, logprobs 1, max_tokens
1, batches of token-id prompts) against a real serving cluster (1 prefill + 1 decode, `tiny`).

The oracle is Hugging Face transformers on the same checkpoint: for every (context,
continuation) the harness scored, its log-likelihood is the sum of transformers' log-softmax over
the continuation's tokens, split as the harness splits them, and "greedy" means each of those
tokens is the argmax; the task's accuracy follows from those.
"""
from __future__ import annotations

import json

import pytest
import torch


DOCS = [
    {"question": "The sky is", "choices": ["blue", "green", "loud"], "answer": 0},
    {"question": "Two plus two is", "choices": ["four", "five"], "answer": 0},
    {"question": "Water is", "choices": ["dry", "wet", "a", "aaaa"], "answer": 1},
    {"question": "x", "choices": ["y", "z"], "answer": 1},
]
TASK = """task: pdcluster_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def oracle(hf_model, tokenizer, context: str, continuation: str) -> tuple[float, bool]:
    """(log-likelihood of the continuation after the context, whether greedy decoding gives it)."""
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    ctx = len(tokenizer.encode(context, add_special_tokens=False))
    with torch.inference_mode():
        logits = hf_model(torch.tensor([whole]), attention_mask=torch.ones(1, len(whole), dtype=torch.long)).logits
    lps = torch.log_softmax(logits[0].float(), dim=-1)
    ll = sum(lps[p - 1, whole[p]].item() for p in range(ctx, len(whole)))
    greedy = all(lps[p - 1].argmax().item() == whole[p] for p in range(ctx, len(whole)))
    return ll, greedy


def test_lm_eval_local_completions_scores_a_local_task_as_transformers_does(
        cluster, tiny_dir, hf_model, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    import lm_eval
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tiny_mc.yaml").write_text(TASK.format(data=data))
    args = (f"model=tiny,base_url={cluster.base_url.rstrip('/')}/completions,tokenizer={tiny_dir},"
            "tokenizer_backend=huggingface,max_length=1024")
    res = lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=["pdcluster_tiny_mc"],
                                  task_manager=TaskManager(include_path=str(tasks)), batch_size=2, log_samples=True)
    samples = sorted(res["samples"]["pdcluster_tiny_mc"], key=lambda s: s["doc_id"])
    assert len(samples) == len(DOCS)
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    correct = 0
    for doc, s in zip(DOCS, samples):
        scored = [r for (r,) in s["resps"]]
        assert s["arguments"] == [(doc["question"], " " + c) for c in doc["choices"]]
        want = [oracle(hf_model, tokenizer, ctx, cont) for ctx, cont in s["arguments"]]
        for (ll, greedy), (want_ll, want_greedy) in zip(scored, want):
            assert ll == pytest.approx(want_ll, abs=1e-3) and greedy == want_greedy
        correct += max(range(len(want)), key=lambda i: want[i][0]) == doc["answer"]
    assert res["results"]["pdcluster_tiny_mc"]["acc,none"] == pytest.approx(correct / len(DOCS))
