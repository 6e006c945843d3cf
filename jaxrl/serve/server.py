"""JetStream's orchestrator and gRPC service over one `JetStreamEngine`, with checked
requests and a drain.

    server = Server(host, port, threads=N)     the port bound (a taken one fails here, before
                                               `jaxrl serve` loads or compiles anything)
    server.serve(engine, params, max_new_tokens=C)   the orchestrator over the engine
    server.start()                                   serving
    server.drain(timeout_s)        new requests refused; those in flight finish (or are
                                   cut at the timeout); the orchestrator's threads end

The orchestrator is JetStream's `Driver` in interleaved mode (prefill and generate on the
same devices, the engine's params shared) and its `LLMOrchestrator` service, changed in two
places:

- Requests are checked before they reach the driver (`problem`): JetStream's driver threads
  kill the process on any error, so a request it cannot serve (no content, a token id
  outside the vocabulary, a prompt longer than `serve.max_prefill_length`, `max_tokens`
  outside [1, serve.max_new_tokens], a session cache) gets INVALID_ARGUMENT, naming what is
  wrong, and the server goes on. So does one protobuf cannot parse (text that is not
  UTF-8): the service is registered with a parser that hands it on (`_add_service`), where
  gRPC's own would fail it as UNKNOWN with a traceback in the log.
- Prompts are tokenized and padded by jaxrl (`HFTokenizer.pad`): text as `jaxrl generate`
  encodes it, token ids as given (JetStream would prepend BOS and pad to its own buckets).

The gRPC server is set up as JetStream's `server_lib` sets up its own (an asyncio loop in a
thread), which cannot take another service class or drain before it stops the driver.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent import futures

import grpc
from google.protobuf.message import DecodeError

from jaxrl.config import ConfigError
from jaxrl.serve.engine import JetStreamEngine
from jaxrl.serve.jetstream import jetstream_pb2, orchestrator
from jaxrl.serve.tokenizer import HFTokenizer, PromptTooLong


class Driver(orchestrator.Driver):
    """JetStream's driver; prompts padded by jaxrl's tokenizer (module docstring), and its
    generate loop restarted after its one racy assertion."""

    def _generate_thread(self, idx: int):
        # JetStream's generate loop, having tried to fill its free slots, asserts that some
        # slot is busy; when the detokenize thread frees the last busy slot in between (the
        # last request in flight just finished), the assertion fails and JetStream's thread
        # wrapper kills the process. Every slot is then free: nothing is lost by starting
        # the loop again (with a fresh decode state).
        while self.live:
            try:
                return super()._generate_thread(idx)
            except AssertionError:
                slots = self._generate_engines[idx].max_concurrent_decodes
                if self._generate_slots[idx].qsize() < slots:
                    raise  # another assertion: not the race

    def _process_prefill_content(self, request, tokenizer: HFTokenizer, is_bos: bool,
                                 max_prefill_length: int):
        content = request.prefill_content
        ids = tokenizer.ids(content) if isinstance(content, str) else list(content)
        return tokenizer.pad(ids)


class Orchestrator(orchestrator.LLMOrchestrator):
    """JetStream's service; each request checked first (module docstring)."""

    def __init__(self, driver: Driver, tokenizer: HFTokenizer, *, vocab_size: int,
                 max_new_tokens: int):
        super().__init__(driver=driver)
        self.tokenizer, self.vocab_size, self.max_new_tokens = tokenizer, vocab_size, max_new_tokens

    def problem(self, request) -> str | None:
        """Why `request` cannot be served, or None."""
        if isinstance(request, Unparsable):
            return request.problem
        if request.session_cache:
            return "session_cache is not supported: send the whole prompt"
        if not 1 <= request.max_tokens <= self.max_new_tokens:
            return (f"max_tokens must be in [1, {self.max_new_tokens}] (this server's "
                    f"serve.max_new_tokens), got {request.max_tokens}")
        which = request.WhichOneof("content")
        if which is None:
            return "the request has no content: set text_content or token_content"
        if which == "text_content":
            try:
                ids = self.tokenizer.ids(request.text_content.text)
            except ValueError as e:  # a prompt that encodes to no tokens
                return f"text_content: {e}"
        else:
            ids = list(request.token_content.token_ids)
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                return (f"token_content: token ids must be in [0, {self.vocab_size}) (the "
                        f"model's vocabulary), got {bad[:5]}")
            if not ids:
                return "token_content: no token ids"
        try:
            self.tokenizer.pad(ids)
        except PromptTooLong as e:
            return str(e)
        return None

    async def Decode(self, request, context=None):  # noqa: N802 (gRPC's method name)
        problem = self.problem(request)
        if problem is not None:
            if context is None:
                raise ValueError(problem)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        async for response in super().Decode(request, context):
            yield response


class Unparsable:
    """A Decode request protobuf could not parse, and why (answered INVALID_ARGUMENT)."""

    def __init__(self, problem: str):
        self.problem = problem


def _parse_decode(data: bytes):
    """A DecodeRequest from its bytes, or an `Unparsable` saying what is wrong."""
    try:
        return jetstream_pb2.DecodeRequest.FromString(data)
    except DecodeError as e:
        return Unparsable(f"the request is not a DecodeRequest protobuf can read ({e}): "
                          f"text_content.text must be valid UTF-8 (send other bytes as "
                          f"token_content)")


def _add_service(service: Orchestrator, server) -> None:
    """JetStream's generated `add_OrchestratorServicer_to_server`, with Decode's requests
    parsed by `_parse_decode` (module docstring)."""
    pb = jetstream_pb2
    handlers = {
        "Decode": grpc.unary_stream_rpc_method_handler(
            service.Decode, request_deserializer=_parse_decode,
            response_serializer=pb.DecodeResponse.SerializeToString),
        "HealthCheck": grpc.unary_unary_rpc_method_handler(
            service.HealthCheck, request_deserializer=pb.HealthCheckRequest.FromString,
            response_serializer=pb.HealthCheckResponse.SerializeToString),
    }
    name = pb.DESCRIPTOR.services_by_name["Orchestrator"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))


class Server:
    """The engine served over gRPC (module docstring)."""

    def __init__(self, host: str, port: int, *, threads: int = 64):
        self.driver = None
        # As JetStream's server_lib: gRPC's thread pool as big as the slots, at least 64
        # (`threads`: the most slots there may be; threads start only as requests come).
        self._executor = futures.ThreadPoolExecutor(max_workers=max(threads, 64))
        self._loop = asyncio.new_event_loop()
        self._loop.set_default_executor(self._executor)
        self._thread = threading.Thread(target=self._loop.run_forever, name="grpc-loop",
                                        daemon=True)
        self._thread.start()

        async def bind():
            # No SO_REUSEPORT (gRPC's default): a second server on a taken port must fail,
            # not share the port's requests with the first.
            server = grpc.aio.server(self._executor, options=[("grpc.so_reuseport", 0)])
            try:
                return server, server.add_insecure_port(f"{host}:{port}")
            except RuntimeError:  # grpc.aio's "Failed to bind"
                return server, 0

        # Bound before the driver starts its threads, which a failure would leave running.
        self._grpc, self.port = self._call(bind())
        if not self.port:
            self._stop_loop()
            raise ConfigError(f"cannot listen on {host}:{port} (serve.host, serve.port): the "
                              f"port is taken or the address is not this machine's")

    def serve(self, engine: JetStreamEngine, params, *, max_new_tokens: int) -> None:
        """JetStream's orchestrator over `engine` (its threads start here) as the service."""
        self.driver = Driver(prefill_engines=[engine], generate_engines=[engine],
                             prefill_params=[params], generate_params=[params],
                             interleaved_mode=True)
        try:
            tokenizer = engine.build_tokenizer(engine.get_tokenizer())
            self.service = Orchestrator(self.driver, tokenizer,
                                        vocab_size=engine.model_config.vocab_size,
                                        max_new_tokens=max_new_tokens)
            _add_service(self.service, self._grpc)
        except BaseException:
            self.close()  # the driver's threads would keep the process alive
            raise

    def _call(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def start(self) -> None:
        self._call(self._grpc.start())

    def drain(self, timeout_s: float, on_refusing: Callable[[], None] | None = None) -> None:
        """Refuses new requests, lets those in flight finish for up to `timeout_s` seconds,
        then stops the orchestrator and the event loop. `on_refusing` runs once new requests
        are refused (gRPC's stop marks the server as shutting down before its first await),
        so an announcement made there is never ahead of the refusal."""
        async def stop():
            stopping = asyncio.ensure_future(self._grpc.stop(grace=timeout_s))
            await asyncio.sleep(0)  # stop() has run up to its first await: refusing now
            if on_refusing is not None:
                on_refusing()
            await stopping

        self._call(stop())
        self.close()

    def close(self) -> None:
        """Stops at once (requests in flight are cut): the gRPC server, the orchestrator's
        threads (one of them not a daemon: left running, it keeps the process alive), the
        event loop. Safe to call again."""
        if self._thread.is_alive():
            self._call(self._grpc.stop(grace=None))
        if self.driver is not None:
            self.driver.stop()
            self.driver = None
        self._stop_loop()

    def _stop_loop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
        self._executor.shutdown(wait=False)
