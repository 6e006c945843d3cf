"""`jaxrl serve` as a real process on the 8 devices: it serves a run's checkpoint (--step)
with its slots split over the devices, prints its address, and on SIGTERM finishes every
request in flight (queued ones too) and exits 0."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import pytest

from jaxrl.serve.jetstream import jetstream_pb2, jetstream_pb2_grpc

pytestmark = pytest.mark.process  # each test starts `jaxrl serve`

MAX_TOKENS = 300


def _free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _start(args):
    process = subprocess.Popen([sys.executable, "-m", "jaxrl.cli", "serve", *args],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "JAX_PLATFORMS": "cpu"})
    lines, ready = [], threading.Event()

    def read():
        for line in process.stderr:
            lines.append(line)
            if "serving on" in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    return process, lines, ready


def test_sigterm_drains_requests_in_flight_and_exits_0(trained_run):
    port = _free_port()
    process, lines, ready = _start([
        f"train.run_dir={trained_run}", "--step", "1", f"serve.port={port}",
        "serve.host=localhost", "serve.max_slots=4", "serve.sampling.temperature=0",
        "sharding.layout=dp_fsdp_tp",
        "rollout.ignore_eos=true", f"serve.max_new_tokens={MAX_TOKENS}",
        "serve.max_prefill_length=32"])
    try:
        assert ready.wait(240), "".join(lines)
        assert any(f"serving on localhost:{port}" in line for line in lines)
        # The 4 slots split over the 8 devices' data x fsdp (2 x 2), one per device.
        assert any("4 slots (1 per device over data x fsdp (4 devices))" in line
                   for line in lines), "".join(lines)
        channel = grpc.insecure_channel(f"localhost:{port}")
        stub = jetstream_pb2_grpc.OrchestratorStub(channel)
        counts, started, errors = [0] * 6, [threading.Event() for _ in range(6)], []

        def ask(i):
            request = jetstream_pb2.DecodeRequest(
                text_content=jetstream_pb2.DecodeRequest.TextContent(text="1+1="),
                max_tokens=MAX_TOKENS)
            try:
                for response in stub.Decode(request, timeout=120):
                    counts[i] += sum(len(s.token_ids) for s in response.stream_content.samples)
                    started[i].set()
            except grpc.RpcError as e:  # pragma: no cover - reported below
                errors.append(e)
                started[i].set()

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        assert started[0].wait(60)
        process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        while not any("draining" in line for line in lines) and time.monotonic() < deadline:
            time.sleep(0.05)
        # Draining: a new request is refused (the 6 in flight go on).
        late = jetstream_pb2.DecodeRequest(
            text_content=jetstream_pb2.DecodeRequest.TextContent(text="2+2="), max_tokens=4)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Decode(late, timeout=30))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        for t in threads:
            t.join(120)
        # 6 requests over 4 slots: at SIGTERM some were still queued; all finished.
        assert not errors, errors
        assert counts == [MAX_TOKENS] * 6
        out, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, "".join(lines)
    assert any("SIGTERM received: draining" in line for line in lines)
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["policy"] == f"checkpoint of step 1 of {trained_run}"
    assert summary["port"] == port and summary["slots"] == 4


def test_a_second_server_on_a_taken_port_exits_2(model_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "jaxrl.cli", "serve", f"model.path={model_dir}",
             f"serve.port={port}", "serve.host=127.0.0.1", "serve.max_slots=2",
             "serve.warmup=false", "serve.max_prefill_length=16"],
            capture_output=True, text=True, timeout=240)
    assert result.returncode == 2, result.stderr
    assert f"127.0.0.1:{port}" in result.stderr and "serve.port" in result.stderr
