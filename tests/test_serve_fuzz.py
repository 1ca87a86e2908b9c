"""Every bad client input gets a 4xx in OpenAI's error shape, never a 500, and the keep-alive
connection it came on still answers a correct request correctly afterwards.

One live server (stories260K on a free loopback port, as in test_serve.py); one
``http.client`` connection per test, so "the same keep-alive connection" is checked for real:
the socket object must survive every exchange. The corpus is generated: hypothesis over JSON
values for every field of both generation routes (wrong types, extreme numbers written as
raw JSON text -- thousands of digits, 1e309, -0, NaN and Infinity literals --, lone
surrogates, deep nesting), raw byte strings (invalid UTF-8, truncated JSON), and chat
messages of every shape. The oracle for the correct request is offline ``LLM.generate``.
"""

import http.client
import json
import socket
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from conftest import require_module
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mie import LLM, SamplingParams
from mie.engine.llm_engine import LLMEngine

httpx = require_module("httpx")
serve = require_module("mie.serve")  # the server stack: starlette, uvicorn
build_app, serve_in_thread = serve.build_app, serve.serve_in_thread

STORIES = Path(__file__).resolve().parents[1] / "models" / "stories260K"
BACKEND = "python"
TIMEOUT = 60.0
MODEL = "stories260K"
CHECK_PROMPT = "Once upon a time"
CHECK_TOKENS = 8

COMPLETION_FIELDS = [
    "model",
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "stream",
    "stream_options",
    "n",
    "best_of",
    "echo",
    "logprobs",
    "suffix",
    "logit_bias",
    "presence_penalty",
    "frequency_penalty",
    "user",
]
CHAT_FIELDS = [
    "model",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "stream",
    "stream_options",
    "n",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "functions",
    "response_format",
    "logit_bias",
]


class Connection:
    """One keep-alive HTTP/1.1 connection; every exchange must leave it open."""

    def __init__(self, url: str):
        parts = urlsplit(url)
        self.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=TIMEOUT)
        self.conn.connect()
        # http.client writes headers and body separately: without this, Nagle's algorithm
        # and delayed ACKs add ~40 ms to every exchange.
        self.conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = self.conn.sock

    def request(self, path: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
        assert self.conn.sock is self.sock, "the server closed the keep-alive connection"
        self.conn.request("POST", path, body, {"Content-Type": "application/json"})
        response = self.conn.getresponse()
        data = response.read()
        assert not response.will_close, (response.status, data[:300])
        return response.status, dict(response.getheaders()), data

    def close(self) -> None:
        self.conn.close()


@pytest.fixture(scope="module")
def server():
    engine = LLMEngine(STORIES, backend=BACKEND, num_blocks=512, max_num_seqs=16)
    with serve_in_thread(build_app(engine, STORIES)) as url:
        yield url


@pytest.fixture(scope="module")
def expected_text():
    llm = LLM(STORIES, backend=BACKEND, num_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=CHECK_TOKENS)
    return llm.generate(CHECK_PROMPT, params, use_tqdm=False)[0].outputs[0].text


@pytest.fixture
def connection(server):
    conn = Connection(server)
    yield conn
    conn.close()


def assert_openai_error(status: int, data: bytes) -> dict:
    """A 4xx whose body is OpenAI's error object, exactly."""
    assert 400 <= status < 500, (status, data[:500])
    body = json.loads(data)
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)
    assert error["param"] is None or isinstance(error["param"], str)
    assert error["code"] is None or isinstance(error["code"], str)
    return error


def assert_answered(status: int, headers: dict, data: bytes) -> None:
    """Not a 5xx: either OpenAI's error (4xx) or a well-formed answer (a request that the
    generator happened to make valid)."""
    if status != 200:
        assert_openai_error(status, data)
    elif headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[6:] for line in data.decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", events[-3:]
        for event in events[:-1]:
            assert "error" not in json.loads(event), event
    else:
        assert json.loads(data)["choices"], data[:300]


def check_still_serves(connection: Connection, expected_text: str) -> None:
    """The same connection answers a correct request with the offline answer."""
    body = {"model": MODEL, "prompt": CHECK_PROMPT, "max_tokens": CHECK_TOKENS, "temperature": 0}
    status, _, data = connection.request("/v1/completions", json.dumps(body).encode())
    assert status == 200, data
    assert json.loads(data)["choices"][0]["text"] == expected_text


# -- the corpus ---------------------------------------------------------------------------------
LONE_SURROGATES = ["\ud800", "\udfff", "abc\ud800", "\udc00x", "\ud83d"]  # high, low, cut emoji

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
    | st.sampled_from(LONE_SURROGATES)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4)
    ),
    max_leaves=8,
)

# JSON text json.dumps cannot write or that only a hand-written body holds.
RAW_VALUES = [
    "1" * 5000,  # past Python's 4300-digit int-parsing limit: ValueError, not JSONDecodeError
    "-" + "9" * 4299,  # just within it: a number no field can take
    "1" * 400,  # an int too large for a float
    "1e309",
    "-1e309",
    "1e-400",
    "-0",
    "-0.0",
    "0e0",
    "NaN",
    "Infinity",
    "-Infinity",
    "[" * 5000 + "]" * 5000,  # deeper than json.loads' recursion limit
    "[" * 50 + "1" + "]" * 50,
    '"\\ud800"',
    '"abc\\ud800"',
    '"\\udfff\\ud800"',
    '"\\u0000"',
    '"\\ud83d\\ude00"',
    '{"a": ' * 200 + "1" + "}" * 200,
    "true",
    "[]",
    "{}",
    '""',
    '" "',
]


def value_text(value) -> str:
    return json.dumps(value)  # NaN / Infinity are written as their (non-standard) literals


def raw_field_values():
    return st.one_of(json_values.map(value_text), st.sampled_from(RAW_VALUES))


def body_with(base: dict, field: str, raw_value: str) -> bytes:
    """``base`` with ``field`` set to raw JSON text (a repeated key: json.loads keeps the
    last one, so the base's own value is overridden)."""
    return (json.dumps(base)[:-1] + f', "{field}": {raw_value}}}').encode("utf-8", "surrogatepass")


COMPLETION_BASE = {"model": MODEL, "prompt": "Once", "max_tokens": 4}
CHAT_BASE = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
SETTINGS = settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@SETTINGS
@given(field=st.sampled_from(COMPLETION_FIELDS), raw=raw_field_values())
def test_any_value_of_any_completion_field_is_answered_never_a_500(
    connection, expected_text, field, raw
):
    assert_answered(*connection.request("/v1/completions", body_with(COMPLETION_BASE, field, raw)))
    check_still_serves(connection, expected_text)


@SETTINGS
@given(field=st.sampled_from(CHAT_FIELDS), raw=raw_field_values())
def test_any_value_of_any_chat_field_is_answered_never_a_500(connection, expected_text, field, raw):
    assert_answered(*connection.request("/v1/chat/completions", body_with(CHAT_BASE, field, raw)))
    check_still_serves(connection, expected_text)


messages = st.lists(
    st.one_of(
        json_values,
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["system", "user", "assistant", "tool", "", "USER"])
                | json_values,
                "content": st.one_of(
                    json_values,
                    st.lists(
                        st.fixed_dictionaries(
                            {"type": st.just("text") | json_values, "text": json_values}
                        ),
                        max_size=3,
                    ),
                ),
            },
        ),
    ),
    max_size=4,
)


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(messages=messages)
def test_any_chat_messages_are_answered_never_a_500(connection, expected_text, messages):
    body = body_with(CHAT_BASE, "messages", value_text(messages))
    assert_answered(*connection.request("/v1/chat/completions", body))
    check_still_serves(connection, expected_text)


def raw_bodies():
    valid = json.dumps({**COMPLETION_BASE, "stream": True}).encode()
    return st.one_of(
        st.binary(max_size=200),
        st.integers(0, len(valid) - 1).map(lambda n: valid[:n]),  # truncated JSON
        st.tuples(st.integers(0, len(valid)), st.binary(min_size=1, max_size=8)).map(
            lambda cut: valid[: cut[0]] + cut[1] + valid[cut[0] :]  # bytes spliced in
        ),
        st.sampled_from(
            [
                b"\xff\xfe",
                b'{"model": "\xc3\x28"}',
                b"\xed\xa0\x80",  # bad UTF-8
                b'{"prompt": "Once\xff"}',
                b"\x00",
                b"null",
                b"[]",
                b"1",
                b'"x"',
                b"{}",
                b" ",
                b"",
                b"\xef\xbb\xbf{}",
                b"{" * 3000,
            ]
        ),
    )


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]), body=raw_bodies())
def test_any_bytes_as_a_body_are_answered_never_a_500(connection, expected_text, path, body):
    assert_answered(*connection.request(path, body))
    check_still_serves(connection, expected_text)


# -- known bad values, as regression tests -----------------------------------------------------
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_an_integer_of_thousands_of_digits_is_a_400_and_the_connection_lives(
    connection, expected_text, path
):
    base = COMPLETION_BASE if path == "/v1/completions" else CHAT_BASE
    status, _, data = connection.request(path, body_with(base, "max_tokens", "1" * 5000))
    error = assert_openai_error(status, data)
    assert status == 400 and error["code"] == "invalid_json", error
    check_still_serves(connection, expected_text)


def test_a_prompt_with_a_lone_surrogate_is_a_400_naming_the_prompt(connection, expected_text):
    status, _, data = connection.request(
        "/v1/completions", body_with(COMPLETION_BASE, "prompt", '"abc\\ud800"')
    )
    error = assert_openai_error(status, data)
    assert status == 400 and error["param"] == "prompt" and "surrogate" in error["message"]
    status, _, data = connection.request(
        "/v1/chat/completions",
        body_with(CHAT_BASE, "messages", '[{"role": "user", "content": "abc\\ud800"}]'),
    )
    error = assert_openai_error(status, data)
    assert status == 400 and error["param"] == "messages[0].content"
    check_still_serves(connection, expected_text)


@pytest.mark.parametrize(
    ("field", "raw", "param"),
    [
        ("temperature", "1" * 400, "temperature"),
        ("top_p", "1" * 400, "top_p"),
        ("temperature", "1e309", "temperature"),
        ("temperature", "NaN", "temperature"),
        ("top_p", "NaN", "top_p"),
        ("max_tokens", "-0", "max_tokens"),
        ("stop", "[" * 5000 + "]" * 5000, None),
    ],
)
def test_extreme_numbers_and_nesting_are_400s(connection, field, raw, param):
    status, _, data = connection.request("/v1/completions", body_with(COMPLETION_BASE, field, raw))
    error = assert_openai_error(status, data)
    assert status == 400 and error["param"] == param, error


def test_a_model_named_with_a_lone_surrogate_is_an_unknown_model(connection):
    body = body_with(COMPLETION_BASE, "model", '"abc\\ud800"')
    status, _, data = connection.request("/v1/completions", body)
    error = assert_openai_error(status, data)
    assert status == 404 and error["param"] == "model" and error["code"] == "model_not_found"


def test_a_chunked_body_over_the_limit_is_a_400_without_reading_it_all(server):
    # No Content-Length to refuse it up front: the size is counted while reading.
    def chunks():
        for _ in range(64):
            yield b" " * (1 << 15)  # 2 MiB in all, more than the 1 MiB limit

    response = httpx.post(server + "/v1/completions", content=chunks(), timeout=TIMEOUT)
    error = assert_openai_error(response.status_code, response.content)
    assert response.status_code == 400 and error["code"] == "body_too_large"
    assert response.headers["connection"] == "close"


@pytest.mark.parametrize(
    "raw",
    [
        b"NOT HTTP AT ALL\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000,  # no end of headers in sight
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
    ],
    ids=["garbage", "bad-header-line", "headers-over-16KiB", "negative-length"],
)
def test_malformed_http_is_a_400_from_the_http_layer_and_the_server_serves_on(
    server, expected_text, raw
):
    host, port = urlsplit(server).hostname, urlsplit(server).port
    with socket.create_connection((host, port), timeout=TIMEOUT) as sock:
        sock.sendall(raw)
        answer = b""
        while chunk := sock.recv(65536):  # the server answers, then closes
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
    connection = Connection(server)
    check_still_serves(connection, expected_text)
    connection.close()


def test_unexpected_errors_are_a_500_in_openai_shape_on_a_connection_that_lives(
    expected_text, monkeypatch
):
    from mie.serve import app as app_module

    def broken(*args, **kwargs):
        raise RuntimeError("a bug after validation")

    engine = LLMEngine(STORIES, backend=BACKEND, num_blocks=64)
    with serve_in_thread(build_app(engine, STORIES)) as url:
        connection = Connection(url)
        monkeypatch.setattr(app_module.protocol, "completion", broken)
        status, _, data = connection.request(
            "/v1/completions",
            json.dumps({"model": MODEL, "prompt": CHECK_PROMPT, "max_tokens": 2}).encode(),
        )
        assert status == 500, data
        error = json.loads(data)["error"]
        assert error["type"] == "server_error" and "a bug after validation" in error["message"]
        assert set(error) == {"message", "type", "param", "code"}
        monkeypatch.undo()
        check_still_serves(connection, expected_text)
        connection.close()
