"""`echo` and prompt logprobs (issue 14, item 5), against a real serving cluster (1 prefill +
1 decode, `tiny`), with Hugging Face transformers on the same checkpoint as the oracle: each
prompt token's logprob (and the top ones) equals transformers' log-softmax at the position
before it. Log-likelihood requests as evaluation harnesses send them (`max_tokens` 0 or 1, a
batch of token-id prompts) and streaming are checked against the same oracle.
"""
from __future__ import annotations

import pytest
import torch

from common import nothing_left_running, sse_events

MODEL = "tiny"
PROMPT = [(11 * i + 5) % 250 + 1 for i in range(40)]     # two and a half blocks
TOL = 1e-4


@pytest.fixture(scope="module")
def hf_logprobs(hf_model):
    """hf_logprobs(ids) -> [len(ids), vocab] log-softmax of transformers' logits."""
    def run(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            logits = hf_model(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long)).logits
        return torch.log_softmax(logits[0].float(), dim=-1)
    return run


def token_name(server, t: int) -> str:
    """A token as OpenAI's logprobs name it: its text, or "token_id:N" when it is only part of
    a character (a byte of a UTF-8 sequence)."""
    s = server.tokenizer.decode([t], skip_special_tokens=False)
    return f"token_id:{t}" if "\ufffd" in s else s


def check_prompt_part(server, lp: dict, prompt: list[int], want: torch.Tensor, k: int) -> None:
    """The first len(prompt) entries of an echoed answer's logprobs against the oracle."""
    n = len(prompt)
    assert lp["tokens"][:n] == [token_name(server, t) for t in prompt]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for p in range(1, n):
        assert abs(lp["token_logprobs"][p] - want[p - 1, prompt[p]].item()) < TOL, p
        vals, idx = want[p - 1].topk(k)
        top = lp["top_logprobs"][p]
        assert len(top) == k
        assert sorted(top.values(), reverse=True) == pytest.approx(vals.tolist(), abs=TOL)
        assert set(top) == {token_name(server, t) for t in idx.tolist()}


@pytest.mark.parametrize("max_tokens", [0, 1, 5])
def test_echoed_prompt_logprobs_equal_transformers(cluster, client, hf_logprobs, max_tokens):
    r = client.post("completions", json={"model": MODEL, "prompt": PROMPT, "echo": True, "logprobs": 2,
                                         "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    out = choice["token_ids"]
    assert len(out) == max_tokens and choice["finish_reason"] == "length"
    want = hf_logprobs(PROMPT + out)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == len(PROMPT) + max_tokens
    check_prompt_part(cluster.server, lp, PROMPT, want, 2)
    for i, t in enumerate(out):                     # the generated tokens: greedy, with their logprobs
        p = len(PROMPT) + i
        assert t == want[p - 1].argmax().item()
        assert abs(lp["token_logprobs"][p] - want[p - 1, t].item()) < TOL
    tok = cluster.server.tokenizer
    assert choice["text"] == tok.decode(PROMPT) + tok.decode(out)
    assert lp["text_offset"][0] == 0 and lp["text_offset"][1] == len(lp["tokens"][0])
    usage = r.json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(PROMPT), max_tokens)
    nothing_left_running(cluster)


def test_a_log_likelihood_batch_as_harnesses_send_it(cluster, client, hf_logprobs):
    # lm-eval's local-completions: context + continuation as token ids, several per request,
    # max_tokens 1, echo, logprobs 1; the continuation's logprob is the sum over its tokens.
    prompts = [PROMPT[:12], PROMPT[5:30], [7]]
    r = client.post("completions", json={"model": MODEL, "prompt": prompts, "echo": True, "logprobs": 1,
                                         "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    for prompt, c in zip(prompts, choices):
        lp = c["logprobs"]
        assert len(lp["token_logprobs"]) == len(prompt) + 1
        want = hf_logprobs(prompt)
        start = max(1, len(prompt) // 2)                 # the continuation: the prompt's second half
        continuation = sum(lp["token_logprobs"][start:len(prompt)])
        assert continuation == pytest.approx(
            sum(want[p - 1, prompt[p]].item() for p in range(start, len(prompt))), abs=1e-3)
    nothing_left_running(cluster)


def test_a_streamed_echo_equals_the_whole_one(cluster, client):
    body = {"model": MODEL, "prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}
    whole = client.post("completions", json=body).json()["choices"][0]
    events = sse_events(client.post("completions", json={**body, "stream": True}).text)
    assert events[-1] == "[DONE]" and all("error" not in e for e in events[:-1])
    text, lp = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in events[:-1]:
        (c,) = e["choices"]
        text += c["text"]
        for key in lp:
            lp[key] += c["logprobs"][key]
    assert text == whole["text"] and lp == whole["logprobs"]

    zero = {**body, "max_tokens": 0, "logprobs": None}
    events = sse_events(client.post("completions", json={**zero, "stream": True}).text)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == cluster.server.tokenizer.decode(PROMPT)
    assert client.post("completions", json=zero).json()["choices"][0]["text"] == cluster.server.tokenizer.decode(PROMPT)
    nothing_left_running(cluster)


@pytest.mark.parametrize("endpoint,body,param", [
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "echo": True}, "echo"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "hi", "echo": "yes"}, "echo"),
    ("completions", {"prompt": "hi", "echo": True, "logprobs": 21}, "logprobs"),
])
def test_echo_misused_is_refused(client, endpoint, body, param):
    r = client.post(endpoint, json={"model": MODEL, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
