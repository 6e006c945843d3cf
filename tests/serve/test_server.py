"""jaxrl's engine behind JetStream's orchestrator and gRPC service, asked with JetStream's own
client stubs: `jaxrl generate`'s greedy text; 64 concurrent requests over 4 slots; each
request's max_tokens; token ids in and out; a malformed request gets a gRPC error and the
server goes on."""

import concurrent.futures

import grpc
import pytest

from jaxrl.serve.jetstream import jetstream_pb2, jetstream_pb2_grpc
from jaxrl.serve.server import Server
from tests.serve.conftest import PROMPTS, generate_greedy
from tests.serve.test_engine import NEW, PREFILL, make_engine

SLOTS = 4


@pytest.fixture(scope="module")
def channel(model_dir):
    engine = make_engine(model_dir, slots=SLOTS)
    engine.warmup()
    server = Server("localhost", 0)
    server.serve(engine, engine.load_params(), max_new_tokens=NEW)
    server.start()
    with grpc.insecure_channel(f"localhost:{server.port}") as channel:
        yield channel
    server.drain(timeout_s=5)


@pytest.fixture(scope="module")
def stub(channel):
    return jetstream_pb2_grpc.OrchestratorStub(channel)


def text_request(text, max_tokens=NEW):
    return jetstream_pb2.DecodeRequest(
        text_content=jetstream_pb2.DecodeRequest.TextContent(text=text), max_tokens=max_tokens)


def ask(stub, request):
    """(text, token ids) of a streamed Decode."""
    text, ids = [], []
    for response in stub.Decode(request, timeout=120):
        for sample in response.stream_content.samples:
            text.append(sample.text)
            ids += sample.token_ids
    return "".join(text), ids


@pytest.fixture(scope="module")
def want(model_dir):
    return generate_greedy(model_dir, PROMPTS, NEW)


def test_served_greedy_text_is_jaxrl_generates(stub, want):
    for prompt in PROMPTS:
        text, ids = ask(stub, text_request(prompt))
        assert text == want[prompt][0], prompt
        # generate counts the stop token it ended on; the server does not send it
        assert len(ids) in (want[prompt][1], want[prompt][1] - 1)


def test_64_concurrent_requests_over_4_slots_all_complete(stub, want):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(64)]
    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        texts = list(pool.map(lambda p: ask(stub, text_request(p))[0], prompts))
    assert texts == [want[p][0] for p in prompts]


def test_each_request_gets_its_max_tokens(stub):
    full = {p: ask(stub, text_request(p))[1] for p in PROMPTS[:3]}
    assert any(len(ids) == NEW for ids in full.values())  # some run to the cap
    for prompt in PROMPTS[:3]:
        for max_tokens in (1, 3, NEW - 1):
            _, ids = ask(stub, text_request(prompt, max_tokens))
            # greedy: a prefix of the longer answer, cut at max_tokens unless it stopped
            assert ids == full[prompt][:max_tokens]
            assert len(ids) == min(max_tokens, len(full[prompt]))


def test_token_ids_in_and_out(stub):
    """Token content (client-side tokenization): the prompt's ids as given, ids back."""
    _, ids = ask(stub, text_request("abc"))
    request = jetstream_pb2.DecodeRequest(
        token_content=jetstream_pb2.DecodeRequest.TokenContent(token_ids=_ids("abc")),
        max_tokens=NEW)
    responses = list(stub.Decode(request, timeout=120))
    got = [t for r in responses for s in r.stream_content.samples for t in s.token_ids]
    assert got == ids
    assert all(s.text == "" for r in responses for s in r.stream_content.samples)


_TOKENIZER = {}


def _ids(text):
    return _TOKENIZER["t"].ids(text)


@pytest.fixture(autouse=True, scope="module")
def _tokenizer(model_dir):
    from jaxrl.serve.tokenizer import HFTokenizer

    _TOKENIZER["t"] = HFTokenizer(str(model_dir), chat_template=True, stop_ids=(2,),
                                  buckets=(16, PREFILL))


@pytest.mark.parametrize("request_, words", [
    (jetstream_pb2.DecodeRequest(max_tokens=4), ["no content"]),
    (text_request("hello", 0), ["max_tokens", "[1, 10]", "got 0"]),
    (text_request("hello", NEW + 1), ["max_tokens", f"got {NEW + 1}"]),
    (text_request("z" * 60), ["tokens", f"serve.max_prefill_length {PREFILL}"]),
    (jetstream_pb2.DecodeRequest(
        token_content=jetstream_pb2.DecodeRequest.TokenContent(token_ids=[5, 999, -1]),
        max_tokens=4), ["token ids", "999"]),
    (jetstream_pb2.DecodeRequest(
        token_content=jetstream_pb2.DecodeRequest.TokenContent(token_ids=[]), max_tokens=4),
     ["no token ids"]),
    (jetstream_pb2.DecodeRequest(session_cache="s", max_tokens=4,
                                 text_content=jetstream_pb2.DecodeRequest.TextContent(text="a")),
     ["session_cache"]),
], ids=["no-content", "max-tokens-0", "max-tokens-over", "too-long", "bad-ids", "no-ids",
        "session"])
def test_a_malformed_request_gets_invalid_argument_and_the_server_goes_on(
        stub, want, request_, words):
    with pytest.raises(grpc.RpcError) as e:
        ask(stub, request_)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    for word in words:
        assert word in e.value.details(), (word, e.value.details())
    assert ask(stub, text_request("hello"))[0] == want["hello"][0]
    health = stub.HealthCheck(jetstream_pb2.HealthCheckRequest(), timeout=10)
    assert health.is_live


def test_text_that_is_not_utf8_gets_invalid_argument_and_the_server_goes_on(channel, stub,
                                                                           want):
    """A client that sends bytes as text (protobuf refuses to parse them): INVALID_ARGUMENT
    naming UTF-8, where gRPC's own parser failed the call as UNKNOWN."""
    good = text_request("AB").SerializeToString()
    decode = channel.unary_stream("/jetstream_proto.Orchestrator/Decode",
                                  request_serializer=lambda raw: raw,
                                  response_deserializer=jetstream_pb2.DecodeResponse.FromString)
    with pytest.raises(grpc.RpcError) as e:
        list(decode(good.replace(b"AB", b"\xff\xfe"), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
    assert "String field had bad UTF-8" in e.value.details()
    assert "text_content.text must be valid UTF-8" in e.value.details()
    assert ask(stub, text_request("hello"))[0] == want["hello"][0]


def test_the_generate_loop_restarts_after_jetstreams_racy_assertion(monkeypatch):
    """JetStream's generate loop asserts a busy slot after trying to fill free ones; when the
    last request finished in between (every slot free), jaxrl's driver runs the loop again
    instead of letting JetStream kill the process; any other assertion still fails."""
    import queue
    import types

    from jaxrl.serve.jetstream import orchestrator
    from jaxrl.serve.server import Driver

    calls = []

    def loop(self, idx):
        calls.append(idx)
        if len(calls) == 1:
            raise AssertionError("At this point we must have some requests inserted")

    monkeypatch.setattr(orchestrator.Driver, "_generate_thread", loop)
    driver = Driver.__new__(Driver)
    slots = queue.Queue()
    for slot in range(3):
        slots.put(slot)
    driver.live, driver._generate_slots = True, [slots]
    driver._generate_engines = [types.SimpleNamespace(max_concurrent_decodes=3)]
    driver._generate_thread(0)
    assert calls == [0, 0]
    slots.get()  # a slot busy: the assertion is not the race
    calls.clear()
    with pytest.raises(AssertionError):
        driver._generate_thread(0)
