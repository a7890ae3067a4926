"""`dspark serve` against bad clients: each gets a 4xx/5xx and a bounded wait, and good clients keep being served.

The real server runs in this process on a free port, with the session's tiny verifier and a Zarr
sink, and a 1 s client timeout so that the stalled-connection cases finish quickly.
"""

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from dspark.connector.config import SinkConfig, ZarrConfig
from dspark.connector.producer import MAX_DATA_SETS, Producer
from dspark.core.errors import InputError
from dspark.extract.serve import ExtractionService, ServeLimits, make_server
from dspark.extract.transformers_engine import TransformersEngine

LAYERS = [1, 3, 5]
TIMEOUT = 1.0  # the servers' client timeout here
MODEL_MAX = 4096  # the toy verifier's max_position_embeddings


@pytest.fixture(scope="module")
def parts(verifier, tmp_path_factory):
    engine = TransformersEngine(verifier, LAYERS, device="cpu")
    store = tmp_path_factory.mktemp("serve") / "store"
    producer = Producer(SinkConfig(to="zarr", zarr=ZarrConfig(store=str(store)), prepared_fingerprint="p"),
                        str(verifier), LAYERS, engine.dtype_name)
    yield engine, producer
    producer.close()


def start(parts, client_timeout=TIMEOUT, **limits):
    engine, producer = parts
    service = ExtractionService(engine, producer, "tiny", ServeLimits(client_timeout=client_timeout, **limits))
    server = make_server(service, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return service, server


@pytest.fixture(scope="module")
def served(parts):
    service, server = start(parts)
    yield service, server.server_address[1]
    server.shutdown()
    server.server_close()


def post(port, body, timeout=10.0) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def good(sample_id=0, n=12) -> dict:
    return {"model": "tiny", "prompt": list(range(1, n + 1)), "max_tokens": 1, "return_token_ids": True,
            "kv_transfer_params": {"sample_id": sample_id, "prepared_fingerprint": "p"}}


def assert_serves(port, within=5.0) -> None:
    t0 = time.monotonic()
    code, reply = post(port, good(), timeout=within)
    assert code == 200, reply
    assert reply["choices"][0]["prompt_token_ids"] == good()["prompt"]
    assert time.monotonic() - t0 < within


def raw(port, data: bytes, *, close_write=False, timeout=10.0) -> tuple[int | None, dict | None, float]:
    """Send bytes as they are; (status, JSON reply, seconds until the server closed). None: closed without a reply."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        if close_write:
            s.shutdown(socket.SHUT_WR)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    took = time.monotonic() - t0
    if not got:
        return None, None, took
    head, _, body = got.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body), took


def request_bytes(body: bytes, length: str | None) -> bytes:
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    if length is not None:
        head += f"Content-Length: {length}\r\n"
    return (head + "\r\n").encode() + body


def handler_threads() -> int:
    return sum("process_request_thread" in t.name for t in threading.enumerate())


# --- prompt length -----------------------------------------------------------------------------------------


def test_a_prompt_past_the_model_maximum_is_a_400_naming_the_lengths_without_the_forward_lock(served):
    service, port = served
    assert service.max_model_len == MODEL_MAX
    with service._lock:  # a forward in progress: the refusal must not wait for it
        t0 = time.monotonic()
        code, reply = post(port, {**good(), "prompt": [1] * (MODEL_MAX + 1)}, timeout=5)
        assert time.monotonic() - t0 < 2
    assert code == 400
    assert f"the prompt has {MODEL_MAX + 1} tokens, more than this server's maximum length {MODEL_MAX}" in \
        reply["error"]["message"]
    code, reply = post(port, {**good(), "prompt": [1] * MODEL_MAX})  # the maximum itself is served
    assert code == 200, reply
    assert_serves(port)


def test_a_two_million_token_prompt_is_refused_before_its_body_is_parsed(served):
    service, port = served
    with service._lock:
        t0 = time.monotonic()
        code, reply = post(port, {**good(), "prompt": [1] * 2_000_000}, timeout=10)
        assert time.monotonic() - t0 < 5
    assert code == 413
    assert f"prompts of at most {MODEL_MAX} tokens" in reply["error"]["message"]
    assert_serves(port)


def test_max_model_len_caps_prompts_below_the_model_maximum(parts):
    service, server = start(parts, max_model_len=16)
    try:
        port = server.server_address[1]
        code, reply = post(port, good(n=17))
        assert code == 400 and "17 tokens, more than this server's maximum length 16" in reply["error"]["message"]
        assert post(port, good(n=16))[0] == 200
    finally:
        server.shutdown()
        server.server_close()


def test_max_model_len_past_the_model_maximum_is_refused_at_start(parts):
    engine, producer = parts
    with pytest.raises(InputError, match=f"--max-model-len 5000 is more than the verifier's maximum length "
                                         f"{MODEL_MAX} \\(max_position_embeddings\\)"):
        ExtractionService(engine, producer, "tiny", ServeLimits(max_model_len=5000))
    with pytest.raises(InputError, match="--max-model-len 0 must be >= 1"):
        ServeLimits(max_model_len=0)


# --- bodies that are JSON but wrong ------------------------------------------------------------------------


BAD_BODIES = {
    "a JSON array": ([good()], "the request body must be a JSON object, got list"),
    "a JSON string": ("hello", "the request body must be a JSON object, got str"),
    "JSON null": (None, "the request body must be a JSON object, got NoneType"),
    "kv_transfer_params a list": ({**good(), "kv_transfer_params": [0]}, "kv_transfer_params must be a JSON object"),
    "kv_transfer_params a string": ({**good(), "kv_transfer_params": "0"}, "kv_transfer_params must be a JSON object"),
    "sample_id true": ({**good(), "kv_transfer_params": {"sample_id": True}}, "sample_id must be a non-negative"),
    "sample_id a float": ({**good(), "kv_transfer_params": {"sample_id": 1.0}}, "sample_id must be a non-negative"),
    "sample_id a string": ({**good(), "kv_transfer_params": {"sample_id": "3"}}, "sample_id must be a non-negative"),
    "sample_id negative": ({**good(), "kv_transfer_params": {"sample_id": -1}}, "sample_id must be a non-negative"),
    "fingerprint a number": ({**good(), "kv_transfer_params": {"sample_id": 0, "prepared_fingerprint": 7}},
                             "prepared_fingerprint must be a string"),
    "a boolean token id": ({**good(), "prompt": [1, True, 2]}, "integer token ids"),
    "a float token id": ({**good(), "prompt": [1, 2.0]}, "integer token ids"),
    "a string token id": ({**good(), "prompt": ["1"]}, "integer token ids"),
    "an empty prompt": ({**good(), "prompt": []}, "non-empty list of token ids"),
    "a text prompt": ({**good(), "prompt": "hello"}, "non-empty list of token ids"),
}


@pytest.mark.parametrize("case", BAD_BODIES)
def test_a_json_body_of_the_wrong_shape_is_a_400(served, case):
    _, port = served
    body, message = BAD_BODIES[case]
    code, reply = post(port, body)
    assert code == 400
    assert message in reply["error"]["message"]
    assert_serves(port)


@pytest.mark.parametrize("data", [b"{not json", b"\xff\xfe\x00", b"[" * 100_000, b"1" * 5000, b""],
                         ids=["not JSON", "not UTF-8", "nested too deep", "an integer too long", "empty"])
def test_a_body_that_is_not_json_is_a_400(served, data):
    _, port = served
    code, reply = post(port, data)
    assert code == 400 and reply["error"]["message"] == "request body is not JSON"
    assert_serves(port)


# --- Content-Length and stalled connections ----------------------------------------------------------------


@pytest.mark.parametrize("length, code, message", [
    ("-5", 400, "is not one byte count"),
    ("abc", 400, "is not one byte count"),
    ("+12", 400, "is not one byte count"),
    (None, 411, "send a Content-Length header"),
    (str(10**12), 413, "more than the"),
])
def test_a_bad_content_length_is_refused_at_once(served, length, code, message):
    _, port = served
    got, reply, took = raw(port, request_bytes(json.dumps(good()).encode(), length))
    assert (got, took < TIMEOUT) == (code, True)
    assert message in reply["error"]["message"]
    assert_serves(port)


def test_two_different_content_lengths_are_a_400(served):
    _, port = served
    data = request_bytes(b"{}", "2").replace(b"\r\n\r\n", b"\r\nContent-Length: 3\r\n\r\n")
    got, reply, _ = raw(port, data)
    assert got == 400 and "is not one byte count" in reply["error"]["message"]


def test_a_transfer_encoding_beside_a_content_length_is_a_400(served):
    """HTTP/1.1 (RFC 9112 6.1): a proxy in front may frame the body by the one, this server by the other
    (request smuggling); a body that is valid by its Content-Length must still be refused."""
    _, port = served
    data = request_bytes(json.dumps(good()).encode(), str(len(json.dumps(good()))))
    for te in ("chunked", "gzip, chunked", "identity"):
        got, reply, took = raw(port, data.replace(b"\r\n\r\n", f"\r\nTransfer-Encoding: {te}\r\n\r\n".encode(), 1))
        assert (got, took < TIMEOUT) == (400, True), reply
        assert "both Transfer-Encoding and Content-Length" in reply["error"]["message"]
    assert_serves(port)


def test_a_content_length_longer_than_the_body_is_a_408_after_the_client_timeout(served):
    _, port = served
    body = json.dumps(good()).encode()
    got, reply, took = raw(port, request_bytes(body, str(len(body) + 100)))
    assert got == 408 and "did not arrive within 1 s" in reply["error"]["message"]
    assert TIMEOUT * 0.9 < took < TIMEOUT + 2
    assert_serves(port)


def test_a_body_cut_short_by_the_client_is_a_400(served):
    _, port = served
    body = json.dumps(good()).encode()
    got, reply, took = raw(port, request_bytes(body, str(len(body) + 100)), close_write=True)
    assert got == 400 and f"the body ended after {len(body)} of the {len(body) + 100} bytes" in \
        reply["error"]["message"]
    assert took < TIMEOUT


def test_a_connection_that_sends_nothing_is_answered_408_and_closed(served):
    _, port = served
    got, reply, took = raw(port, b"")
    assert got == 408 and "no whole request within 1 s" in reply["error"]["message"]
    assert TIMEOUT * 0.9 < took < TIMEOUT + 2


def test_headers_sent_a_byte_at_a_time_do_not_stretch_the_client_timeout(served):
    _, port = served
    data = request_bytes(b"{}", "2")
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        try:
            for b in data:  # 1 byte per 0.1 s: each read is quick, the whole request takes ~7 s
                s.sendall(bytes([b]))
                time.sleep(0.1)
        except OSError:  # the server closed the connection: the client's time was up
            pass
        s.settimeout(TIMEOUT + 2)
        while s.recv(65536):
            pass
    assert time.monotonic() - t0 < TIMEOUT + 2


def test_fifty_stalled_connections_hold_fifty_threads_then_close_while_good_requests_are_served(parts):
    timeout = 3.0  # time for a good request on a busy machine before the stalled ones are dropped
    _, server = start(parts, client_timeout=timeout)
    port = server.server_address[1]
    before = handler_threads()
    stalled = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(50)]
    try:
        for s in stalled:  # a lying Content-Length: the body never comes
            s.sendall(request_bytes(b"{", "100"))
        time.sleep(0.2)
        assert handler_threads() <= before + 50
        assert_serves(port, within=timeout)  # served alongside them
        t0 = time.monotonic()
        for s in stalled:
            s.settimeout(max(0.1, t0 + timeout + 2 - time.monotonic()))
            head = b""
            while chunk := s.recv(65536):
                head += chunk
            assert head.startswith(b"HTTP/1.0 408")
        deadline = time.monotonic() + 2
        while handler_threads() > before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert handler_threads() <= before
    finally:
        for s in stalled:
            s.close()
        server.shutdown()
        server.server_close()


def test_connections_past_max_connections_get_a_503_at_once_and_no_thread(parts):
    _, server = start(parts, max_connections=4)
    port = server.server_address[1]
    before = handler_threads()
    stalled = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(4)]
    try:
        for s in stalled:
            s.sendall(request_bytes(b"{", "100"))
        time.sleep(0.2)
        assert handler_threads() == before + 4
        for _ in range(20):
            got, reply, took = raw(port, request_bytes(b"{}", "2"))
            assert got == 503 and "--max-connections" in reply["error"]["message"] and took < TIMEOUT
        assert handler_threads() == before + 4
        time.sleep(TIMEOUT + 0.5)  # the stalled ones time out and free their slots
        assert_serves(port)
    finally:
        for s in stalled:
            s.close()
        server.shutdown()
        server.server_close()


# --- the producer's own checks -----------------------------------------------------------------------------


def test_a_client_naming_ever_new_data_sets_is_refused_past_max_data_sets(verifier):
    producer = Producer(SinkConfig(to="mooncake"), str(verifier), LAYERS, "float32")  # opens no sink until a write
    for i in range(MAX_DATA_SETS - 1):  # the unpinned "" data set is one
        producer.plan(f"r{i}", {"sample_id": i, "prepared_fingerprint": f"f{i}"}, 4)
    with pytest.raises(InputError, match=f"this extractor already writes {MAX_DATA_SETS} data sets"):
        producer.plan("r", {"sample_id": 0, "prepared_fingerprint": "one too many"}, 4)
    producer.plan("r", {"sample_id": 0, "prepared_fingerprint": "f0"}, 4)  # known ones still plan


def test_an_in_process_caller_may_pass_a_numpy_sample_id(verifier):
    producer = Producer(SinkConfig(to="mooncake"), str(verifier), LAYERS, "float32")
    planned = producer.plan("r", {"sample_id": np.int64(3), "prepared_fingerprint": "p"}, 4)
    assert type(planned.sample_id) is int and planned.sample_id == 3
    with pytest.raises(InputError, match="sample_id must be a non-negative integer, got True"):
        producer.plan("r", {"sample_id": True}, 4)
