"""The OpenAI-compatible HTTP front door (FastAPI on uvicorn).

    POST /v1/completions, POST /v1/chat/completions (both with "stream"), GET /v1/models,
    GET /health, GET /metrics

Errors are OpenAI's JSON ({"error": {"message", "type", "param", "code"}}) with the status.
Admission is bounded: past `max_pending` requests in flight, 429 with Retry-After.
A completions request may hold a list of prompts (a batch, at most MAX_PROMPTS): each runs as a
request of its own (admitted together, counted as its prompts), answered as one response with
a choice per prompt, `index` in prompt order; one prompt's failure fails the whole response.
`n` > 1 (and `best_of`) runs that many samples of each prompt, each a request of its own with
its own seed (`sample_seed`), started together from one prefill and one handoff (the
dispatcher's `samples`); choice `index` is prompt x n + sample. best_of > n answers the n
samples of highest cumulative logprob.
A client that goes away cancels its request wherever it is (the dispatcher aborts it).
Shutdown drains (`Server.drain`): new requests get 503, those in flight run up to a timeout,
then each one left ends with an error (an SSE error event and [DONE], or a 503) and is aborted
on the workers.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hmac
import json
import logging
import math
import threading
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import jinja2
import jinja2.sandbox
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from router.admission import REFUSAL_MAX_HOLD_S, RefusalPace, SLOAdmission
from router.dispatch import Dispatcher, RequestFailed
from router.leadership import Leadership
from router.protocol import (CHAT_BODY, COMPLETION_BODY, STRUCTURED_FIELDS, APIError, GenerationRequest, bad_request, chat_messages,
                             check_token_ids, completion_prompts, echo_of, parse_json, request_options,
                             sample_counts, sampling_params, slo_targets, too_large)
from router.slo import SLOTargets, judge
from router.tracing import RequestTrace, Tracing
from router.tools import ToolCallParser, ToolError, deltas, fold, parser_for_template, tool_use, tool_finish_reason
from workers.names import ROLES
from workers.sequence import sample_seed, show
from workers.tokenizer import PLAIN_CHAT_TEMPLATE, Tokenizer

log = logging.getLogger(__name__)

SHUTDOWN = "server_shutdown"           # the error code of a request ended by a drain's timeout
_END = object()                        # the generation task is done (queued after its last event)
_DEADLINE = object()                   # the request's deadline (--request-timeout-s) has passed
MAX_BUFFERED_EVENTS = 1024             # a request's events its client has not read yet, at most
VALIDATOR_THREADS = 2                  # bodies are validated in these threads (json.loads and tokenizing
                                       # release the GIL between their C calls: the loop keeps answering)
INLINE_BODY_BYTES = 1024               # but for one prompt in a body this small: on the loop, in well
                                       # under a millisecond (a thread's hop would cost more)
PROMPT_CHARS_SLACK = 2                 # a prompt text's characters over max_model_len x the longest
                                       # token's (a normalizer may shrink a text a little)


class Detokenizer:
    """Incremental text in O(new tokens) per push: decodes a short window of recent tokens,
    emits only complete characters, and holds back a tail that could still grow into a stop
    string (the text a client sees never contains one, unless `include_stop`: then it ends with
    it). Before `min_tokens` tokens no stop string counts (the engine checks none), and one that
    ended before them counts no more."""
    MAX_PENDING = 8                        # invalid bytes stay invalid: emit after this many

    def __init__(self, tokenizer: Tokenizer, stop: list[str], min_tokens: int = 0, include_stop: bool = False):
        self.tok, self.stop = tokenizer, stop
        self.min_tokens, self.include_stop = min_tokens, include_stop
        self.ids: list[int] = []
        self.prefix = self.read = 0        # window start; end of what is already in `text`
        self.text = ""
        self.sent = 0                      # characters already emitted
        self.armed = 0 if min_tokens <= 1 else None   # where a stop string may end after (None: not yet)
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.stopped = False

    def push(self, ids: list[int], final: bool) -> str:
        self.ids += ids
        if self.armed is None and len(self.ids) >= self.min_tokens:   # (once: the text before the last one)
            self.armed = len(self.tok.decode(self.ids[:self.min_tokens - 1])) + 1
        if not self.stopped:
            before = self.tok.decode(self.ids[self.prefix:self.read])
            after = self.tok.decode(self.ids[self.prefix:])
            if final or not after.endswith("\ufffd") or len(self.ids) - self.read > self.MAX_PENDING:
                self.text += after[len(before):]
                self.prefix, self.read = self.read, len(self.ids)
            for s in self.stop if self.armed is not None else ():   # the engine stopped on it
                at = self.text.find(s, max(0, self.sent - len(s), self.armed - len(s)))
                if at >= 0:
                    self.text, self.stopped = self.text[:at + (len(s) if self.include_stop else 0)], True
        final = final or self.stopped
        end = len(self.text) if final else max(self.sent, len(self.text) - self.holdback)
        out, self.sent = self.text[self.sent:end], end
        return out


class Server:
    def __init__(self, dispatcher: Dispatcher, tokenizer: Tokenizer, model_name: str, max_model_len: int,
                 api_key: str | None = None, max_pending: int = 512, default_max_tokens: int = 16,
                 cluster_info: dict | None = None, max_body_bytes: int = 8 * 2**20,
                 admission: SLOAdmission | None = None, client_stall_timeout_s: float = 30.0,
                 slo: SLOTargets | None = None, request_timeout_s: float | None = 600.0,
                 body_timeout_s: float = 30.0, max_validating: int = 64, leadership: Leadership | None = None,
                 tool_parser: str | None = None, refusals_per_s: float = 500.0, tracing: Tracing | None = None):
        self.dispatcher, self.tokenizer = dispatcher, tokenizer
        self.tracing = tracing                 # request traces (router/tracing.py); None: off
        self.leadership = leadership or Leadership(leads=True)   # a router of its own leads its pools
        self.request_timeout_s = request_timeout_s # a request still running this long after it arrived ends (504)
        self.body_timeout_s = body_timeout_s     # a body not whole within this long is refused (408)
        self.max_validating = max_validating     # bodies being read or validated at once; more wait in line
        self.validation = Line()
        # a full server's 429s: at most this many a second, each held within the TTFT target
        self.refusal_pace = RefusalPace(refusals_per_s, min(REFUSAL_MAX_HOLD_S, slo.ttft_s if slo else math.inf))
        self._grammars = None                  # workers/grammar.py Grammars, on the first structured request
        self._grammar_lock = threading.Lock()  # (validation threads share its cache)
        self._validator = ThreadPoolExecutor(VALIDATOR_THREADS, thread_name_prefix="validate")
        self.max_prompt_chars = PROMPT_CHARS_SLACK * max_model_len * tokenizer.max_token_chars
        self.slo = slo                         # the requests' default TTFT and TPOT targets (None: none)
        self.admission = admission             # SLO admission (router/admission.py); None: the queue bound only
        self.client_stall_timeout_s = client_stall_timeout_s
        self.max_body_bytes = max_body_bytes   # larger bodies get 413, unread (RouterConfig.max_body_bytes)
        self.model_name, self.max_model_len = model_name, max_model_len
        self.api_key, self.max_pending = api_key, max_pending
        self.default_max_tokens = default_max_tokens
        self.cluster_info = cluster_info or {}
        self.pending = 0
        self.metrics = dispatcher.metrics
        self.draining = False                  # start_drain(): no new requests, /health says so
        self.ending = False                    # end_inflight(): whatever still runs ends with an error
        self.ended = 0                         # requests end_inflight() ended
        self._runs: set[asyncio.Task] = set()  # each running request's dispatcher.generate task
        self._idle: asyncio.Event | None = None   # set by _done when nothing is in flight
        template = tokenizer.chat_template or PLAIN_CHAT_TEMPLATE
        self.chat_template = sandboxed_template(template, bos_token=tokenizer.bos_token or "",
                                                eos_token=tokenizer.eos_token or "")
        self.tool_parser = tool_parser or parser_for_template(template)   # how its answers call tools

    # -- validation ----------------------------------------------------------------------------
    def _check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        sent = request.headers.get("authorization", "").encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(sent, f"Bearer {self.api_key}".encode()):      # in constant time
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           "authentication_error", code="invalid_api_key")

    async def _read(self, request: Request) -> bytes:
        """The raw body, at most `max_body_bytes` of it: a larger Content-Length is refused before
        reading, and a chunked body as soon as it passes the limit, so no body is buffered whole
        (uvicorn discards the rest of an unread body and keeps the connection)."""
        limit = self.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise too_large(limit, int(declared))
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.body_timeout_s):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise too_large(limit)
                    chunks.append(chunk)
        except ClientDisconnect:
            raise bad_request("the client closed the connection before the whole body arrived") from None
        except TimeoutError:
            raise APIError(408, f"the request body did not arrive within {self.body_timeout_s:g}s ({size} bytes "
                           "came)", code="request_timeout") from None
        return b"".join(chunks)

    def _body(self, raw: bytes) -> dict:
        body = parse_json(raw)
        model = body.get("model")
        if model is None:
            raise bad_request("'model' is required", "model")
        if not isinstance(model, str):
            raise bad_request(f"'model' must be a string, got {show(model)}", "model")
        if model != self.model_name:
            raise APIError(404, f"the model {show(model)} does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")
        return body

    def _encode(self, text: str, param: str) -> list[int]:
        """The text's tokens; a text surely longer than the context is refused before tokenizing
        (in time linear in it, not the tokenizer's)."""
        self._check_chars(len(text), param)
        return self.tokenizer.encode(text)      # parse_json refused what no tokenizer takes (surrogates)

    def _check_chars(self, chars: int, param: str) -> None:
        if chars > self.max_prompt_chars:
            raise bad_request(f"the prompt has {chars} characters, far more than fit this model's maximum context "
                              f"length of {self.max_model_len} tokens", param)

    def _check_len(self, ids: list[int], param: str) -> None:
        if not ids:
            raise bad_request("the prompt is empty", param)
        if len(ids) >= self.max_model_len:
            raise bad_request(f"the prompt has {len(ids)} tokens; this model's maximum context length is "
                              f"{self.max_model_len} (prompt plus at least one generated token)", param)

    def completion_request(self, body: dict) -> GenerationRequest | list[GenerationRequest]:
        """One prompt gives one request; a batch of several prompts a list of requests in prompt
        order, each run as a request of its own with the same sampling parameters (a seed
        included, as vLLM does). One invalid prompt refuses the whole batch, naming its index."""
        prompts, batch = completion_prompts(body)
        for name, neutral in (("tools", []), ("tool_choice", "none")):
            if body.get(name) is not None and body[name] != neutral:
                raise bad_request(f"{name} is a chat completions field (POST /v1/chat/completions); completions "
                                  "have no tools", name)
        token_ids = []
        for i, prompt in enumerate(prompts):
            try:
                if isinstance(prompt, str):
                    ids = self._encode(prompt, "prompt")
                else:
                    ids = prompt
                    check_token_ids(ids, self.tokenizer.vocab_size, "prompt")
                self._check_len(ids, "prompt")
            except APIError as e:
                if batch:
                    e.message = f"prompt[{i}]: {e.message}"
                raise
            token_ids.append(ids)
        reqs = self._requests(body, "completion", token_ids)
        return reqs if len(reqs) > 1 else reqs[0]

    def _word_tokens(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def check_grammar(self, spec: dict) -> str | None:
        """Why a structured output's grammar cannot be served (it does not compile for this
        model's tokenizer), or None; compiled in the validation thread, cached by its text."""
        with self._grammar_lock:
            if self._grammars is None:
                from workers.grammar import Grammars
                self._grammars = Grammars(self.tokenizer)
            return self._grammars.check(spec)

    def chat_request(self, body: dict) -> GenerationRequest:
        """The messages and tools rendered by the model's chat template (as HF transformers'
        apply_chat_template renders them); tool_choice "required" or named forces the calls."""
        flat = chat_messages(body)
        try:
            tools, use, forced = tool_use(body, self.tool_parser)
        except ToolError as e:
            raise bad_request(str(e), e.param) from None
        self._check_chars(sum(len(m["content"]) for m in flat), "messages")
        try:
            text = self.chat_template.render(messages=flat, tools=tools, add_generation_prompt=True)
        except jinja2.TemplateError as e:     # raise_exception's too; the sandbox's SecurityError
            raise bad_request(f"the chat template could not render these messages: {show(str(e), 200)}",
                              "messages") from None
        except (TypeError, ValueError) as e:  # e.g. tojson on what JSON cannot hold
            raise bad_request(f"the chat template could not render these messages: {show(str(e), 200)}",
                              "messages") from None
        ids = self._encode(text, "messages")
        self._check_len(ids, "messages")
        req = self._requests(body, "chat", [ids], None if forced is None else ("tools", forced))[0]
        req.tools = use
        return req

    def _requests(self, body: dict, kind: str, prompts: list[list[int]],
                  forced: tuple[str, dict] | None = None) -> list[GenerationRequest]:
        """A request per prompt, all with the body's sampling parameters and options (`forced`:
        the structured output a tool_choice forces)."""
        params = sampling_params(body, self.default_max_tokens, self.tokenizer.vocab_size, self.check_grammar,
                                 forced, self._word_tokens)
        for i, ids in enumerate(prompts):
            if len(ids) + params.max_tokens > self.max_model_len:
                which = f"prompt[{i}]" if len(prompts) > 1 else "prompt"
                raise bad_request(f"{which} ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds the "
                                  f"maximum context length {self.max_model_len}", "max_tokens")
        stream, include_usage, priority = request_options(body)
        n, best_of = sample_counts(body, stream, len(prompts))
        echo = echo_of(body, kind, params)
        ttft_s, tpot_s = slo_targets(body, *((self.slo.ttft_s, self.slo.tpot_s) if self.slo else (None, None)))
        now = time.monotonic()
        due = None if ttft_s is None else now + ttft_s
        deadline = None if self.request_timeout_s is None else now + self.request_timeout_s
        return [GenerationRequest(kind, self.model_name, ids, params, stream, include_usage, priority=priority,
                                  echo=echo, n=n, best_of=best_of, ttft_due=due, tpot_s=tpot_s, deadline=deadline)
                for ids in prompts]

    def samples(self, req: GenerationRequest) -> list[GenerationRequest]:
        """The request's samples (best_of of them): sample j seeded with `sample_seed(seed, j)`;
        when they are to be ranked, each keeps its tokens' logprobs (answered only if asked)."""
        if req.best_of == 1:
            return [req]
        rank = req.best_of > req.n and req.params.logprobs is None
        return [dataclasses.replace(req, params=dataclasses.replace(
                    req.params, seed=sample_seed(req.params.seed, j), logprobs=0 if rank else req.params.logprobs))
                for j in range(req.best_of)]

    def shares_start(self, req: GenerationRequest) -> bool:
        """Whether the samples can start from one carrier: it computes the prompt and one token
        more, which must fit the context (otherwise each sample prefills on its own), and which
        computes no prompt logprobs (samples that echo them each compute their own)."""
        return (req.best_of > 1 and len(req.prompt_token_ids) + 2 <= self.max_model_len
                and req.params.prompt_logprobs is None)

    # -- running one request -------------------------------------------------------------------
    def _admit(self, req: GenerationRequest | list[GenerationRequest]) -> None:
        """Let the request in, or refuse it: 503 while draining, 429 past `max_pending` in flight
        or (SLO admission) when it would miss its SLO; Retry-After says when to come back.
        A batch of prompts is let in or refused whole, once, and counts as its prompts (each
        runs as a request of its own); SLO admission prices the batch's prompts together."""
        reqs = req if isinstance(req, list) else [req]
        sequences = sum(r.best_of for r in reqs)
        if self.draining:
            self.metrics.errors.labels("shutdown").inc()
            raise APIError(503, "the server is shutting down and admits no new requests; send it elsewhere",
                           "server_error", code="draining")
        if sequences > self.max_pending:                  # would never fit: coming back does not help
            self.metrics.errors.labels("invalid_request").inc()
            raise bad_request(f"this request's {sequences} sequences (prompts x best_of) are more than the "
                              f"{self.max_pending} requests this server runs at once; send fewer per request",
                              "prompt" if len(reqs) > 1 else "n")
        for r in reqs:
            self.metrics.observe_offered(len(r.prompt_token_ids), r.params.max_tokens * r.best_of)
        if self.pending + sequences > self.max_pending:
            self.metrics.errors.labels("overloaded").inc()
            raise APIError(429, f"the server is at capacity ({self.max_pending} requests in flight); "
                           "retry shortly", "rate_limit_exceeded", code="overloaded",
                           headers={"Retry-After": "1"})
        if self.admission is not None:
            req = reqs[0]
            prompts = [len(r.prompt_token_ids) for r in reqs]
            v = self.admission.check(sum(prompts), req.params.max_tokens, req.priority)
            if v.code:
                verdict = "probe" if v.probe else "on_record" if v.on_record else "refused"
                self.metrics.admission_refusals.labels(v.code, verdict).inc()
            if not v.admit:
                self.metrics.errors.labels("slo_unattainable").inc()
                wait = max(1, math.ceil(v.retry_after_s))
                raise APIError(429, f"this request would miss the server's {v.code.upper()} target: {v.reason}; "
                               f"retry in {wait}s", "rate_limit_exceeded", code="slo_unattainable",
                               headers={"Retry-After": str(wait)})
            if len(reqs) == 1:     # a batch's prediction is its last prompt's: no measure for each one
                req.predicted_ttft_s, req.ttft_limit_s, req.seat_s = v.predicted_ttft_s, v.ttft_limit_s, v.seat_s
                req.probe = v.code if v.probe else ""
            pledge = self.admission.pledge(sum(prompts), sequences)
            for r in reqs:
                r.pledge = pledge
        self.pending += sequences

    async def _paced(self) -> None:
        """Holds a 429 of a full server until its turn (router/admission.py RefusalPace)."""
        hold = self.refusal_pace.hold(asyncio.get_running_loop().time(),
                                      self.admission.served_per_s() if self.admission is not None else None)
        if hold > 0:
            await asyncio.sleep(hold)

    def _release(self, reqs: list[GenerationRequest]) -> None:
        """A response that `_admit` let in has ended: its slots and any pledge its runs left."""
        self._done(sum(r.best_of for r in reqs))
        if self.admission is not None:
            self.admission.redeem(reqs[0].pledge)

    def _done(self, n: int = 1) -> None:
        self.pending -= n
        if self.pending == 0 and self._idle is not None:
            self._idle.set()

    # -- draining --------------------------------------------------------------------------------
    def start_drain(self) -> None:
        """From now on new requests get 503 and /health answers 503 "draining"; those in flight run on."""
        self.draining = True

    async def drained(self, timeout: float) -> bool:
        """Waits (at most `timeout` seconds) until no request is in flight; whether none is."""
        if self.pending == 0:
            return True
        if self._idle is None or self._idle.is_set():
            self._idle = asyncio.Event()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            pass
        return self.pending == 0

    async def end_inflight(self, timeout: float = 5.0) -> int:
        """Ends every request still in flight: its work on the workers is cancelled (the dispatcher
        aborts it there, so its blocks come back) and its client gets an error, a stream as an SSE
        error event then [DONE], a whole response as a 503; waits (at most `timeout`) until those
        responses are out. Returns how many requests it ended."""
        self.ending = True
        runs = [t for t in self._runs if not t.done()]
        for t in runs:
            t.cancel()
        self.ended += len(runs)
        await self.drained(timeout)
        return len(runs)

    async def drain(self, timeout: float) -> bool:
        """Stop admitting, let what is in flight finish within `timeout` seconds, then end the rest
        (end_inflight). True when every request finished on its own."""
        self.start_drain()
        if not await self.drained(timeout):
            await self.end_inflight()
        return self.ended == 0

    # -- one request's generation ----------------------------------------------------------------
    def _shutdown_error(self, n_out: int) -> APIError:
        return APIError(503, f"the server shut down before this request finished ({n_out} token"
                        f"{'' if n_out == 1 else 's'} generated); retry it", "server_error", code=SHUTDOWN)

    async def _generate(self, req: GenerationRequest, events: asyncio.Queue, source=None) -> None:
        async for ev in source if source is not None else self.dispatcher.generate(req):
            if events.qsize() >= MAX_BUFFERED_EVENTS:      # its client reads slower than the tokens come
                self.metrics.errors.labels("slow_client").inc()
                log.warning("a request's client read %d events behind its tokens: ended and aborted",
                            MAX_BUFFERED_EVENTS)
                raise SlowClient(f"the client read too slowly ({MAX_BUFFERED_EVENTS} events behind its tokens)")
            events.put_nowait(ev)

    def _generation_done(self, task: asyncio.Task, events: asyncio.Queue) -> None:
        self._runs.discard(task)
        if not task.cancelled():
            task.exception()                         # retrieved here; run() re-raises it
        events.put_nowait(_END)

    async def run(self, req: GenerationRequest, source=None, shares_prompt: bool = False):
        """Yields a TextDelta per event (prompt logprobs, asked for, with the first only);
        records metrics.
        The request counts as waiting until its first token, then as running.
        The dispatcher runs in a task of its own, so that a drain can end the request (cancel
        that task: the dispatcher aborts it on the workers) and still answer its client.
        `source`: its TokenDeltas (a sample of a shared start), else `dispatcher.generate`'s;
        `shares_prompt`: another sample's prefill computes its prompt (counted there)."""
        if self.ending:
            self.metrics.errors.labels("shutdown").inc()
            raise self._shutdown_error(0)
        detok = Detokenizer(self.tokenizer, req.params.stop, req.params.min_tokens, req.params.include_stop_str_in_output)
        t0 = last = time.monotonic()
        ttft = 0.0
        n_out = 0
        first_given = False
        m = self.metrics
        prompt_tokens = 0 if shares_prompt else len(req.prompt_token_ids)
        m.observe_arrival(prompt_tokens)
        m.waiting.inc()
        ticket = None
        if self.admission is not None:
            self.admission.redeem(req.pledge)
            ticket = self.admission.started(prompt_tokens, req.predicted_ttft_s, req.params.max_tokens, req.seat_s)
            req.on_placed = functools.partial(self.admission.placed, ticket)
        events: asyncio.Queue = asyncio.Queue()
        # One timer at the deadline, not one per event: it puts _DEADLINE among the events.
        deadline = (None if req.deadline is None else
                    asyncio.get_running_loop().call_at(_loop_time(req.deadline), events.put_nowait, _DEADLINE))
        task = asyncio.ensure_future(self._generate(req, events, source))
        self._runs.add(task)
        task.add_done_callback(lambda t: self._generation_done(t, events))
        try:
            while True:
                ev = await events.get()
                if ev is _DEADLINE:
                    raise DeadlinePassed
                if ev is _END:
                    if task.cancelled():                 # ended by end_inflight
                        raise self._shutdown_error(n_out)
                    task.result()                        # RequestFailed, or a worker's APIError
                    raise RequestFailed("the request ended without a finish")
                now = time.monotonic()
                if ev.token_ids:
                    if n_out == 0:
                        if req.trace is not None:
                            req.trace.first_token()
                        ttft = now - t0
                        m.ttft.observe(ttft)
                        m.observe_prediction(req.predicted_ttft_s, ttft)
                        m.waiting.dec()
                        m.running.inc()
                    else:
                        for _ in ev.token_ids:
                            m.itl.observe((now - last) / len(ev.token_ids))
                    n_out += len(ev.token_ids)
                    last = now
                    if ticket is not None:
                        self.admission.progress(ticket, n_out, ttft)
                    m.generation_tokens.inc(len(ev.token_ids))
                text = detok.push(ev.token_ids, ev.finished)
                plp = None if first_given else ev.prompt_logprobs      # a resume may send them again
                first_given = True
                yield TextDelta(text, ev.token_ids, ev.finish_reason if ev.finished else None, ev.logprobs, plp)
                if ev.finished:
                    if req.trace is not None:
                        req.trace.finished(ev.finish_reason, n_out)
                    e2e = time.monotonic() - t0
                    m.observe_finished(ttft if n_out else e2e, e2e, n_out, t0, req.params.max_tokens)
                    if req.probe and self.admission is not None:
                        met = ttft <= req.ttft_limit_s and judge(self.admission.slo, ttft, e2e, n_out).tpot
                        self.admission.probed(req.probe, met)
                        m.admission_probes.labels(req.probe, "met" if met else "missed").inc()
                    m.success.labels(ev.finish_reason or "stop").inc()
                    return
        except SlowClient as e:                          # counted where it was found
            raise APIError(408, str(e), code="slow_client") from None
        except DeadlinePassed:                           # the finally aborts it on the workers
            m.errors.labels("request_timeout").inc()
            log.warning("request %s: past its deadline (--request-timeout-s %gs) after %d tokens: ended",
                        req.request_id, self.request_timeout_s, n_out)
            raise APIError(504, f"the request did not finish within this server's request timeout of "
                           f"{self.request_timeout_s:g}s ({n_out} tokens generated)", "server_error",
                           code="request_timeout") from None
        except RequestFailed as e:
            m.errors.labels("worker_failure").inc()
            # The log has the cause (worker ids, transport errors); the client gets the request id.
            log.warning("request %s could not be served: %s", req.request_id, e)
            raise APIError(503, f"the request could not be served (request {req.request_id}); retry it",
                           "server_error", code="service_unavailable") from None
        except APIError as e:                            # a worker refused it (e.g. bad params), or a drain
            m.errors.labels("shutdown" if e.code == SHUTDOWN else "invalid_request").inc()
            raise
        except asyncio.CancelledError:
            m.errors.labels("client_disconnect").inc()
            raise
        finally:
            if deadline is not None:
                deadline.cancel()
            task.cancel()                                # the client left (or it is done): abort it
            (m.running if n_out else m.waiting).dec()
            if ticket is not None:
                self.admission.ended(ticket)


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


class FrontDoor(FastAPI):
    """The app: POST /v1/completions and /v1/chat/completions go straight to their handler,
    past FastAPI's routing and Starlette's middleware (a served request's tokens cost the router
    less: each SSE chunk's send went through two wrappers, each stream had an anyio task group);
    every other request, and those two paths' other methods, is FastAPI's. The two routes are
    still declared on FastAPI (for /openapi.json; a request reaching them there is served the
    same way). Errors answer in OpenAI's shape either way."""

    def __init__(self, server: Server, **kwargs):
        super().__init__(**kwargs)
        self.server = server
        self.direct = {} if server is None else {"/v1/completions": server.completion_request,
                                                 "/v1/chat/completions": server.chat_request}

    async def __call__(self, scope, receive, send) -> None:
        parse = self.direct.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if parse is None:
            await super().__call__(scope, receive, send)
            return
        request = Request(scope, receive)
        tracing = self.server.tracing
        trace = tracing.start(request.headers) if tracing is not None else None
        status = 500
        try:
            try:
                response = await _answer(self.server, request, parse, trace)
            except APIError as e:
                response = _error_response(e)
            except Exception as e:
                response = _internal_error(request, e)
            status = response.status_code
            await response(scope, receive, send)
        finally:
            if trace is not None:
                trace.end(status)


async def _answer(server: Server, request: Request, parse, trace: RequestTrace | None = None) -> Response:
    req = await _validated(server, request, parse)
    if trace is not None:
        trace.validated()
        for r in _as_batch(req):
            r.trace = trace
    answer = await _respond(server, request, req)
    return JSONResponse(answer) if isinstance(answer, dict) else answer


def _internal_error(request: Request, e: Exception) -> JSONResponse:
    log.error("internal error answering %s %s", request.method, request.url.path, exc_info=e)
    return _error_response(APIError(500, "internal error; the server's log has the details", "server_error"))


def build_app(server: Server) -> FastAPI:
    app = FrontDoor(server, title="pdcluster", docs_url=None, redoc_url=None)

    @app.exception_handler(APIError)
    async def api_error(_request, e: APIError):
        return _error_response(e)

    @app.exception_handler(Exception)
    async def internal(request: Request, e: Exception):
        return _internal_error(request, e)

    def endpoints() -> str:
        return ", ".join(f"{m} {r.path}" for r in app.routes if isinstance(r, APIRoute) for m in sorted(r.methods))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        """Starlette's own errors (unknown path, wrong method) in OpenAI's shape, never {"detail": ...}."""
        path = request.url.path
        if e.status_code == 404:
            err = APIError(404, f"unknown path '{path}'; the endpoints are: {endpoints()}", code="not_found")
        elif e.status_code == 405:
            err = APIError(405, f"method {request.method} is not allowed on '{path}'; the endpoints are: "
                           f"{endpoints()}", code="method_not_allowed")
        else:
            err = APIError(e.status_code, f"{e.detail} ({request.method} {path})",
                           "server_error" if e.status_code >= 500 else "invalid_request_error")
        err.headers = dict(e.headers or {})           # e.g. 405's Allow
        return _error_response(err)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request, e: RequestValidationError):
        # The handlers read their bodies themselves, so FastAPI validates nothing today; a route
        # with typed parameters must still answer in OpenAI's shape.
        first = next(iter(e.errors()), {})
        loc = [str(x) for x in first.get("loc", ()) if x not in ("body", "query", "path", "header")]
        return _error_response(bad_request(f"invalid request: {first.get('msg', e)}", ".".join(loc) or None))

    @app.get("/health")
    async def health():
        alive = {r: server.dispatcher.pools.count(r) for r in ROLES}
        leads = server.leadership.leads                # this router leads the cluster (cluster/run/book.py)
        if server.draining:                            # a load balancer stops sending here
            return JSONResponse({"status": "draining", "workers": alive, "leads": leads}, status_code=503)
        ok = server.dispatcher.serves()
        return JSONResponse({"status": "ok" if ok else "degraded", "workers": alive, "leads": leads},
                            status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models(request: Request):
        server._check_auth(request)
        return {"object": "list", "data": [{
            "id": server.model_name, "object": "model", "created": 0, "owned_by": "pdcluster",
            "max_model_len": server.max_model_len, **server.cluster_info}]}

    @app.get("/debug/phases")
    async def phases(request: Request):
        """Traced requests' time to first token by phase (router/tracing.py), the newest, by trace id."""
        server._check_auth(request)
        tracing = server.tracing
        return {"tracing": tracing is not None, "requests": dict(tracing.phases) if tracing is not None else {}}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions", openapi_extra=_body(COMPLETION_BODY))
    async def completions(request: Request):
        return await _answer(server, request, server.completion_request)

    @app.post("/v1/chat/completions", openapi_extra=_body(CHAT_BODY))
    async def chat(request: Request):
        return await _answer(server, request, server.chat_request)

    return app


def _body(schema: dict) -> dict:
    """An endpoint's request body for /openapi.json (the handler reads and checks it itself)."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


async def _validated(server: Server, request: Request, parse) -> GenerationRequest:
    """Authentication and validation; a request refused here counts as an invalid_request error.
    The key and the content type are checked first, from the head alone: a stranger never takes
    a place in the line. At most `max_validating` bodies are read or validated at once; the
    others wait in line, unread (a burst of clients is a line, not a refusal), and get 429 when
    the line holds `max_pending` already or after `body_timeout_s` in it. The body must arrive
    within `body_timeout_s` (408), and it is parsed, tokenized and rendered in a validator
    thread, so that the event loop goes on streaming and answering /health meanwhile; only a
    body of at most INLINE_BODY_BYTES with one prompt (or a few messages) is checked on the loop
    (a small body may still hold 256 prompts to tokenize: milliseconds).
    A bug in validation answers 500 through the APIError handler: an exception reaching
    Starlette's last-resort handler is re-raised after its 500, and uvicorn then drops the
    client's keep-alive connection."""
    try:
        server._check_auth(request)
        _check_content_type(request)
    except APIError:
        server.metrics.errors.labels("invalid_request").inc()
        raise
    line = server.validation
    if len(line.waiters) >= server.max_pending:
        server.metrics.errors.labels("overloaded").inc()
        raise APIError(429, f"{server.max_pending} request bodies are waiting to be read already; retry shortly",
                       "rate_limit_exceeded", code="overloaded", headers={"Retry-After": "1"})
    if not await line.enter(server.max_validating, server.body_timeout_s):
        server.metrics.errors.labels("overloaded").inc()
        raise APIError(429, f"no request body could be read within {server.body_timeout_s:g}s: the server is "
                       f"reading {server.max_validating} already; retry shortly", "rate_limit_exceeded",
                       code="overloaded", headers={"Retry-After": "1"})
    try:
        raw = await server._read(request)

        if len(raw) <= INLINE_BODY_BYTES:
            body = server._body(raw)
            if _one_prompt(body):
                return parse(body)
            return await asyncio.get_running_loop().run_in_executor(server._validator, parse, body)
        return await asyncio.get_running_loop().run_in_executor(server._validator, lambda: parse(server._body(raw)))
    except APIError:
        server.metrics.errors.labels("invalid_request").inc()
        raise
    except Exception:
        log.exception("validating a request failed")
        raise APIError(500, "internal error while validating the request; the server's log has the details",
                       "server_error") from None
    finally:
        line.leave()


def _one_prompt(body: dict) -> bool:
    """A completions body with one prompt, or a chat body with a few messages, that asks for no
    grammar (compiling one may take long for a small body; tools may force one): cheap to finish."""
    if any(body.get(name) is not None for name in (*STRUCTURED_FIELDS, "tools", "bad_words")):
        return False
    prompt, messages = body.get("prompt"), body.get("messages")
    if messages is not None:
        return isinstance(messages, list) and len(messages) <= 8
    return isinstance(prompt, str) or (isinstance(prompt, list) and all(type(t) is int for t in prompt))


def _check_content_type(request: Request) -> None:
    """JSON bodies only (415 otherwise): a web page may POST text/plain or a form to a server on
    localhost without asking first, but not application/json."""
    kind = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if kind != "application/json":
        raise APIError(415, f"the request body must be JSON, sent with 'Content-Type: application/json' (got "
                       f"{show(kind or 'none', 60)})", code="unsupported_media_type")


def _loop_time(deadline: float | None) -> float | None:
    """A time.monotonic() deadline on the event loop's clock (asyncio.timeout_at's)."""
    if deadline is None:
        return None
    return asyncio.get_running_loop().time() + (deadline - time.monotonic())


def sandboxed_template(source: str, **constants) -> jinja2.Template:
    """A chat template (the model repository's: untrusted) compiled in Jinja's immutable sandbox,
    which refuses attributes that reach Python's internals and any call that changes its data,
    in the environment HF transformers renders templates in (so that a model's template renders
    here as it does there): blocks trimmed, loop controls, `tojson` as JSON (not HTML-escaped),
    `raise_exception`, `strftime_now`, and a namespace that takes no underscore names. Rendered
    once at start on a few conversations: a template that reaches for what the sandbox refuses
    fails here, with a message, instead of on a request."""
    def raise_exception(message):
        raise jinja2.TemplateError(str(message))

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, namespace=_Namespace,
                       strftime_now=lambda fmt: time.strftime(fmt))
    try:
        template = env.from_string(source, globals=constants)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the model's chat template does not compile: {e}") from None
    probes = ([{"role": "user", "content": "Hi"}],
              [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
              [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
               {"role": "user", "content": "Bye"}])
    for messages in probes:
        try:
            template.render(messages=messages, add_generation_prompt=True)
        except jinja2.sandbox.SecurityError as e:
            raise ValueError(f"the model's chat template reaches for what its sandbox refuses ({e}); "
                             "this server does not run it") from None
        except jinja2.TemplateError:
            pass                  # e.g. its raise_exception refusing a system turn: that is its right
    return template


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace (a template's mutable variables), refusing names that start with an
    underscore, which could reach Python's internals."""

    def __init__(*args, **kwargs):
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.sandbox.SecurityError(f"a chat template may not set {name!r} on a namespace")


async def _respond(server: Server, request: Request, req: GenerationRequest | list[GenerationRequest]):
    """Answers a request, or a batch of prompts (a list of requests, one response for them all)."""
    reqs = _as_batch(req)
    trace, t0 = reqs[0].trace, time.time()
    try:
        server._admit(reqs)
    except APIError as e:
        if trace is not None:
            trace.admission(t0, False, reqs[0].predicted_ttft_s, e.code or e.type)
        if e.status == 429:
            await server._paced()
        raise
    if trace is not None:
        trace.admission(t0, True, reqs[0].predicted_ttft_s)
    req = reqs[0]
    rid = ("cmpl-" if req.kind == "completion" else "chatcmpl-") + uuid.uuid4().hex
    for r in reqs:
        r.request_id = rid
    created = int(time.time())
    if req.stream:
        slots = _Slots(server, reqs)
        return ClientStream(_stream(server, reqs, rid, created, slots), server, slots)
    try:
        return await _whole(server, request, reqs, rid, created)
    finally:
        server._release(reqs)


@dataclasses.dataclass(frozen=True, slots=True)
class TextDelta:
    """What `Server.run` yields per event: the text it adds (stop strings and incomplete
    characters held back), its token ids, the finish reason (None until the last), the tokens'
    logprobs and, with the first only, the prompt's."""
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list | None
    prompt_logprobs: list | None


def _as_batch(req: GenerationRequest | list[GenerationRequest]) -> list[GenerationRequest]:
    return req if isinstance(req, list) else [req]


async def _merged(server: Server, reqs: list[GenerationRequest]):
    """Yields (prompt index, sample index, TextDelta) of each of the batch's prompts and each
    prompt's samples, as they come. Each
    sample goes through `Server.run` in a task of its own (a prompt's samples from one shared
    start, where they fit); the first error ends them all, and so does closing or cancelling
    this generator (each run's cleanup aborts its request on the workers). The hand-over queue
    is bounded, so a slow client backs up into each run's own bounded buffer, as a single
    request does."""
    if len(reqs) == 1 and reqs[0].best_of == 1:
        async for item in server.run(reqs[0]):
            yield 0, 0, item
        return
    async with contextlib.AsyncExitStack() as starts:
        runs = []
        for p, req in enumerate(reqs):
            samples = server.samples(req)
            sources = [None] * len(samples)
            if server.shares_start(req):
                sources = await starts.enter_async_context(server.dispatcher.samples(samples))
            runs += [(p, j, server.run(r, sources[j], shares_prompt=sources[j] is not None and j > 0))
                     for j, r in enumerate(samples)]
        out: asyncio.Queue = asyncio.Queue(maxsize=len(runs))

        async def pump(p: int, j: int, run) -> None:
            try:
                async for item in run:
                    await out.put((p, j, item))
            except Exception as e:               # an APIError (or a bug): the consumer re-raises it
                await out.put((p, j, e))
                return
            await out.put((p, j, None))

        tasks = [asyncio.ensure_future(pump(*r)) for r in runs]
        left = len(runs)
        try:
            while left:
                p, j, item = await out.get()
                if item is None:
                    left -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield p, j, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def _whole(server, request: Request, req: GenerationRequest | list[GenerationRequest], rid: str, created: int):
    """Non-streaming: run to completion, but stop (and free) if the client goes away. A batch
    answers a choice per prompt and sample, `index` = prompt x n + sample, and its usage summed
    (every sample generated counts, as OpenAI bills best_of)."""
    reqs = _as_batch(req)
    req = reqs[0]

    async def collect():
        got: dict[tuple[int, int], tuple[list, list, list, list, list]] = {}   # (prompt, sample) -> parts
        async with contextlib.aclosing(_merged(server, reqs)) as events:
            async for p, j, d in events:
                texts, ids, reason, lps, plps = got.setdefault((p, j), ([], [], [None], [], []))
                texts.append(d.text)
                ids += d.token_ids
                if d.logprobs:
                    lps += d.logprobs
                if d.prompt_logprobs:
                    plps += d.prompt_logprobs
                reason[0] = d.finish_reason or reason[0]
        return got

    task = asyncio.ensure_future(collect())
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=0.25)
        if not done and await request.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return Response(status_code=499)
    got = task.result()
    prompt_tokens = sum(len(r.prompt_token_ids) for r in reqs)
    completion_tokens = sum(len(parts[1]) for parts in got.values())
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens}
    want_logprobs = req.params.logprobs is not None
    answers = []                                          # (text, ids, reason, logprobs) in choice order
    for p, r in enumerate(reqs):
        samples = [got[p, j] for j in range(r.best_of)]
        if r.best_of > r.n:                               # the n likeliest, likeliest first
            samples.sort(key=lambda a: -sum(lp["logprob"] for lp in a[3]))
        echo = (server.tokenizer.decode(r.prompt_token_ids), r.prompt_token_ids) if r.echo else ("", None)
        answers += [(echo[0] + "".join(texts), ids, reason[0], lps, None if echo[1] is None else (echo[1], plps))
                    for texts, ids, reason, lps, plps in samples[:r.n]]
    if req.kind == "completion":
        choices = [{"index": i, "text": text, "finish_reason": reason, "token_ids": ids,
                    "logprobs": _completion_logprobs(server, ids, lps, prompt=prompt)[0] if want_logprobs else None}
                   for i, (text, ids, reason, lps, prompt) in enumerate(answers)]
        return {"id": rid, "object": "text_completion", "created": created, "model": req.model,
                "choices": choices, "usage": usage}
    choices = [{"index": i, **_chat_message(req, text, reason),
                "logprobs": _chat_logprobs(server, ids, lps) if want_logprobs else None}
               for i, (text, ids, reason, lps, _) in enumerate(answers)]
    return {"id": rid, "object": "chat.completion", "created": created, "model": req.model,
            "choices": choices, "usage": usage}


def _chat_message(req: GenerationRequest, text: str, reason: str | None) -> dict:
    """A whole chat answer's message and finish reason: its tool calls parsed out of the text
    when the request has tools (the same pieces a stream sends)."""
    if req.tools is None or not req.tools.parses:
        return {"message": {"role": "assistant", "content": text}, "finish_reason": reason}
    parser = ToolCallParser(req.tools)
    content, calls = fold(parser.push(text) + parser.finish())
    message = {"role": "assistant", "content": content if content or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return {"message": message, "finish_reason": tool_finish_reason(req.tools, reason, len(calls))}


class Line:
    """At most `size` holders at once; the others wait their turn, first come first served (a
    leaving holder hands its place to the first waiter). `size` is read at each entry, so it
    may change while the server runs."""

    def __init__(self):
        self.held = 0
        self.waiters: deque[asyncio.Future] = deque()

    async def enter(self, size: int, timeout_s: float) -> bool:
        """Take a place, waiting up to `timeout_s`; False when none came in time."""
        if self.held < size and not self.waiters:
            self.held += 1
            return True
        turn = asyncio.get_running_loop().create_future()
        self.waiters.append(turn)
        try:
            async with asyncio.timeout(timeout_s):
                await turn
            return True
        except TimeoutError:
            return self._gave_up(turn)
        except asyncio.CancelledError:
            if self._gave_up(turn):          # handed a place as the client left: pass it on
                self.leave()
            raise

    def _gave_up(self, turn: asyncio.Future) -> bool:
        """A waiter stops waiting: True when it was handed a place meanwhile (it holds it)."""
        if turn.done() and not turn.cancelled():
            return True
        turn.cancel()
        with contextlib.suppress(ValueError):
            self.waiters.remove(turn)
        return False

    def leave(self) -> None:
        while self.waiters:
            turn = self.waiters.popleft()
            if not turn.done():
                turn.set_result(None)        # its place now: `held` stays
                return
        self.held -= 1


class _Slots:
    """A response's admitted sequences (`Server.pending`) and pledge, given back once, by
    whichever cleanup comes first: a stream's generator, or its response when the generator
    never started (the client was gone before the response's head went out)."""

    def __init__(self, server: Server, reqs: list[GenerationRequest]):
        self.server, self.reqs = server, reqs

    def release(self) -> None:
        if self.reqs:
            self.server._release(self.reqs)
            self.reqs = []


async def _stream(server, req: GenerationRequest | list[GenerationRequest], rid: str, created: int, slots: _Slots):
    """SSE chunks; cancellation (client gone) propagates into the dispatcher, which aborts.
    A batch's (and n's) chunks carry their choice's `index` (prompt x n + sample) and
    interleave as they come; its usage sums. (best_of > n does not stream.)"""
    reqs = _as_batch(req)
    req = reqs[0]
    n_out = 0
    obj = "text_completion" if req.kind == "completion" else "chat.completion.chunk"
    try:
        if req.kind == "chat":
            for i in range(req.n):
                yield _sse({"id": rid, "object": obj, "created": created, "model": req.model,
                            "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                         "finish_reason": None}]})
        offsets: dict[int, int] = {}                       # choice -> text offset of its next token
        unfinished = len(reqs) * req.n
        tail = ""                  # the last choice's last chunk: it goes out with the usage and [DONE]
        parsers = None if req.tools is None or not req.tools.parses else {}   # choice -> its ToolCallParser
        async with contextlib.aclosing(_merged(server, reqs)) as events:
            async for p, j, d in events:
                delta, tok, fin, lp, plp = d.text, d.token_ids, d.finish_reason, d.logprobs, d.prompt_logprobs
                i = p * req.n + j
                n_out += len(tok)
                echo = None
                if i not in offsets:                      # its first chunk: the prompt first (echo)
                    offsets[i] = 0
                    if reqs[p].echo:
                        echo = (reqs[p].prompt_token_ids, plp or [])
                        delta = server.tokenizer.decode(reqs[p].prompt_token_ids) + delta
                # A token whose text is held back (a possible stop string, an incomplete UTF-8
                # sequence) yields no chat chunk: OpenAI's chunks carry text, not token ids, so an
                # empty delta is sent only with the finish_reason. Completion chunks carry the ids.
                calls = None
                if parsers is not None:                    # tool calls: the parser says what is content
                    parser = parsers.setdefault(i, ToolCallParser(req.tools))
                    delta, calls = deltas(parser.push(delta) + (parser.finish() if fin is not None else []))
                    fin = fin and tool_finish_reason(req.tools, fin, parser.calls)
                if fin is None and not delta and not calls and (req.kind == "chat" or not tok):
                    continue
                if req.kind == "completion":
                    choice = {"index": i, "text": delta, "finish_reason": fin, "token_ids": tok}
                    if req.params.logprobs is not None:
                        choice["logprobs"], offsets[i] = _completion_logprobs(server, tok, lp or [], offsets[i], echo)
                else:
                    choice = {"index": i, "delta": {"content": delta} if delta else {}, "finish_reason": fin}
                    if calls:
                        choice["delta"]["tool_calls"] = calls
                chunk = _sse({"id": rid, "object": obj, "created": created, "model": req.model, "choices": [choice]})
                unfinished -= fin is not None
                if unfinished:
                    yield chunk
                else:
                    tail = chunk
        if req.include_usage:
            prompt_tokens = sum(len(r.prompt_token_ids) for r in reqs)
            tail += _sse({"id": rid, "object": obj, "created": created, "model": req.model, "choices": [],
                          "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n_out,
                                    "total_tokens": prompt_tokens + n_out}})
        yield tail + "data: [DONE]\n\n"
    except APIError as e:
        yield tail + _sse(e.body()) + "data: [DONE]\n\n"
    finally:
        slots.release()


class DeadlinePassed(Exception):
    """The request ran past its deadline (--request-timeout-s)."""


class SlowClient(Exception):
    """The client read so far behind its request's tokens that the buffer between filled."""


class ClientStream:
    """An SSE response (an ASGI app) whose client must keep reading: a chunk it does not take
    within the server's `client_stall_timeout_s` (its socket and the transport's buffer full: it
    stopped reading) ends the stream, which aborts the request, so such a client holds no
    request slot, KV or memory for long; uvicorn then closes the connection. A client that
    leaves ends it too: an ASGI 2.4 server says so by failing the send, an older one (uvicorn's
    h11 says 2.3) through receive(), which one task per stream waits on. However the response
    ends (the client gone before its head, or mid-stream), the generator's cleanup runs before
    this returns (which aborts an unfinished request); a generator that never started has none,
    so the slots are given back here."""

    HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8")]
    status_code = 200

    def __init__(self, content, server: Server, slots: _Slots | None = None):
        self.body_iterator, self.server, self.slots = content, server, slots

    async def __call__(self, scope, receive, send) -> None:
        # One timer per stream, not one per chunk: a send records when it began, and the timer,
        # when it fires, ends the stream if a send has been waiting `client_stall_timeout_s`, or
        # sets itself for when the one under way (or the next) could have.
        timeout = self.server.client_stall_timeout_s
        loop, task = asyncio.get_running_loop(), asyncio.current_task()
        sending_since: float | None = None
        ended: str | None = None                         # what cut the stream short, or "over"

        def cut(why: str) -> None:
            nonlocal ended
            if ended is None:
                ended = why
                task.cancel()                            # where it waits: a send, or the next token

        def check() -> None:
            nonlocal timer
            now = loop.time()
            if sending_since is not None and now - sending_since >= timeout:
                cut("stalled")
                return
            timer = loop.call_at((sending_since if sending_since is not None else now) + timeout, check)

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            cut("gone")

        async def timed(message) -> None:
            nonlocal sending_since
            sending_since = loop.time()
            try:
                await send(message)
            finally:
                sending_since = None

        spec = tuple(int(x) for x in scope.get("asgi", {}).get("spec_version", "2.0").split("."))
        watcher = asyncio.ensure_future(watch()) if receive is not None and spec < (2, 4) else None
        timer = loop.call_at(loop.time() + timeout, check)
        try:
            await timed({"type": "http.response.start", "status": self.status_code, "headers": self.HEADERS})
            async for chunk in self.body_iterator:
                await timed({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
            await timed({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if ended is None:                            # not ours: the server's shutdown
                raise
            task.uncancel()
        except OSError:                                  # ASGI 2.4: the client is gone
            ended = "gone"
        finally:
            why, ended = ended, "over"                   # from here on nothing cancels this task
            timer.cancel()
            if watcher is not None:
                watcher.cancel()
            await self.body_iterator.aclose()
            if self.slots is not None:
                self.slots.release()
        if why == "stalled":
            self.server.metrics.errors.labels("slow_client").inc()
            log.warning("a stream's client took no data for %gs: the stream is ended and its request aborted",
                        self.server.client_stall_timeout_s)


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def _completion_logprobs(server, ids: list[int], lps: list[dict], offset: int = 0,
                         prompt: tuple[list[int], list[dict]] | None = None) -> tuple[dict, int]:
    """OpenAI's completion logprobs of the tokens `ids` (theirs: `lps`), their text offsets
    counted from `offset`; with `prompt` (echo: its ids, and the logprobs of its tokens from the
    second), the prompt's tokens first, the first one with none (nothing predicts it). Returns
    them and the offset after them. A token that is no text on its own (part of a UTF-8
    character) is named "token_id:N", as vLLM does, so top_logprobs keys never collide."""
    def text(t: int) -> str:
        s = server.tokenizer.decode([t], skip_special_tokens=False)
        return f"token_id:{t}" if "\ufffd" in s else s

    def top(lp: dict) -> dict:
        return {text(int(k)): v for k, v in lp["top"].items()}
    tokens, token_lps, tops = [], [], []
    if prompt is not None:
        prompt_ids, prompt_lps = prompt
        tokens += [text(t) for t in prompt_ids]
        token_lps += [None] + [lp["logprob"] for lp in prompt_lps]
        tops += [None] + [top(lp) for lp in prompt_lps]
    tokens += [text(t) for t in ids]
    token_lps += [lp["logprob"] for lp in lps]
    tops += [top(lp) for lp in lps]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}, offset


def _chat_logprobs(server, ids: list[int], lps: list[dict]) -> dict:
    dec = server.tokenizer.decode
    return {"content": [{"token": dec([t], skip_special_tokens=False), "logprob": lp["logprob"],
                         "top_logprobs": [{"token": dec([int(k)], skip_special_tokens=False), "logprob": v}
                                          for k, v in lp["top"].items()]} for t, lp in zip(ids, lps)]}
