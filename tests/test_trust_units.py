"""The front door's checks on their own, without a server (issue 26): the JSON shape check is
linear in the body whatever its shape (a backtracking scan is quadratic: its time grows 4x when
the body doubles), chat templates run sandboxed, the API key comes from where a secret
should, and bodies past the reading bound wait in line (issue 27)."""
from __future__ import annotations

import asyncio
import time

import pytest

from cluster.flags import api_key_from
from router.app import Line, sandboxed_template
from router.protocol import MAX_JSON_DEPTH, MAX_JSON_KEYS, MAX_JSON_VALUES, APIError, parse_json


def shapes(n: int) -> dict[str, bytes]:
    head = b'{"model": "tiny", "prompt": "'
    return {"escaped quotes, unclosed": head + b'\\"' * (n // 2),
            "escaped backslashes, unclosed": head + b"\\\\" * (n // 2),
            "opening brackets": b"[" * n,
            "quotes": b'{"x": [' + b'"",' * (n // 3) + b'""]}',
            "keys": b"{" + b",".join(b'"%d":1' % i for i in range(n // 8)) + b"}"}


def best_of(fn, repeats: int = 7) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def refused_or_parsed(raw: bytes) -> None:
    try:
        parse_json(raw)
    except APIError as e:
        assert e.status == 400


@pytest.mark.parametrize("shape", list(shapes(8)))
def test_the_shape_check_is_linear_in_the_body(shape):
    """16x the body costs about 16x the time (the best of seven runs each, so a busy machine's
    pauses drop out); a quadratic scan would cost 256x (the old regex: minutes). The bound, 80x,
    leaves room for noise: beside a busy process a linear 8x once measured 35x (a small body's
    passes stay in the cache, a large one's do not)."""
    small, large = shapes(2**17)[shape], shapes(2**21)[shape]
    ratio = best_of(lambda: refused_or_parsed(large)) / best_of(lambda: refused_or_parsed(small))
    assert ratio < 80, ratio


@pytest.mark.parametrize("raw, says", [
    (b'{"a": "' + b'\\"' * 1000 + b'"}', None),                         # escaped quotes, closed: valid
    (b'{"a": "\\\\", "b": [[[]]]}', None),                               # a string ending in a backslash
    (b'{"a": "[[[[{{{{"}', None),                                        # brackets inside strings do not count
    (b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1), "deeper than"),
    (b'{"a": "\\"}', "brackets do not balance"),                         # unclosed: an escaped quote is no end
    (b'{"a": [' + b"1," * MAX_JSON_VALUES + b"1]}", "JSON values"),
    (b"{" + b",".join(b'"%d":1' % i for i in range(MAX_JSON_KEYS + 1)) + b"}", "object keys"),
    (b'{"a": [' + b"0.5," * 70_000 + b"1]}", "fraction or exponent"),
])
def test_the_shape_check_reads_strings_escapes_and_counts_right(raw, says):
    if says is None:
        assert isinstance(parse_json(raw), dict)
    else:
        with pytest.raises(APIError) as e:
            parse_json(raw)
        assert e.value.status == 400 and says in e.value.message, e.value.message


def test_a_chat_template_that_reaches_for_python_internals_fails_at_start():
    escaping = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ValueError, match="sandbox refuses"):
        sandboxed_template(escaping)
    mutating = "{% set x = messages.append({'role': 'x'}) %}{{ messages[0]['content'] }}"
    with pytest.raises(ValueError, match="sandbox refuses"):
        sandboxed_template(mutating)


def test_a_sandboxed_template_renders_and_may_refuse_with_raise_exception():
    source = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system turns') }}{% endif %}"
              "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    t = sandboxed_template(source, bos_token="<s>")
    assert t.render(messages=[{"role": "user", "content": "Hi"}]) == "<s>[user] Hi\n"
    with pytest.raises(Exception, match="no system turns"):
        t.render(messages=[{"role": "system", "content": "x"}])


def test_the_api_key_comes_from_the_flag_a_file_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("PDCLUSTER_API_KEY", raising=False)
    assert api_key_from(None, None) is None
    monkeypatch.setenv("PDCLUSTER_API_KEY", "from-env")
    assert api_key_from(None, None) == "from-env"
    assert api_key_from("from-flag", None) == "from-flag"
    f = tmp_path / "key"
    f.write_text("from-file\nsecond line ignored\n")
    assert api_key_from(None, str(f)) == "from-file"
    with pytest.raises(ValueError, match="once"):
        api_key_from("a", str(f))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="no key"):
        api_key_from(None, str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="cannot read"):
        api_key_from(None, str(tmp_path / "missing"))


def test_the_router_config_never_shows_its_key():
    from router.config import RouterConfig
    assert "s3cret" not in repr(RouterConfig(api_key="s3cret"))


def test_the_shape_check_reads_the_same_a_piece_at_a_time(monkeypatch):
    """The strings are cut out a piece at a time (the GIL passes between pieces): with 3-byte
    pieces, every body of quotes, backslashes and brackets reads as it does whole (one
    replace-and-split over the body: the definition)."""
    import random

    import router.protocol as protocol

    def whole(raw: bytes) -> bytes:
        unescaped = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
        return b"".join(unescaped.split(b'"')[::2])
    monkeypatch.setattr(protocol, "_PIECE_BYTES", 3)
    rnd = random.Random(26)
    for _ in range(5000):
        raw = bytes(rnd.choice(b'ab\\"[]{},:') for _ in range(rnd.randint(0, 40)))
        assert protocol._structure(raw) == whole(raw), raw


def test_the_line_for_bodies_serves_in_order_times_out_and_passes_on_a_place_its_waiter_left():
    """router/app.py Line: at most `size` holders; the rest wait first come first served; a
    waiter that gives up (timeout) holds nothing; one cancelled after it was handed a place
    hands it on, so no place is lost."""
    async def scenario():
        line, order = Line(), []

        async def holder(name: str, timeout_s: float = 60.0):
            if not await line.enter(1, timeout_s):
                order.append(f"{name} gave up")
                return
            order.append(name)
            await asyncio.sleep(0)
            line.leave()

        assert await line.enter(1, 1.0)                       # the first holder
        cancelled = asyncio.ensure_future(holder("cancelled"))
        waiters = [asyncio.ensure_future(holder(n)) for n in ("a", "b")]
        late = asyncio.ensure_future(holder("late", timeout_s=0.01))
        await asyncio.wait_for(late, 30)
        assert order == ["late gave up"] and len(line.waiters) == 3
        line.leave()                                           # the first in line is handed the place ...
        cancelled.cancel()                                     # ... and leaves before it runs: a gets it
        await asyncio.wait_for(asyncio.gather(*waiters), 30)
        assert cancelled.cancelled()
        assert order == ["late gave up", "a", "b"] and line.held == 0 and not line.waiters
        assert await line.enter(1, 1.0) and line.held == 1
    asyncio.run(scenario())
