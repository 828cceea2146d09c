"""Drive a real Dynamo 1.6.1 deployment against kvrouter and print what kvrouter saw, as one JSON object.

    python tests/fleet/dynamo_stack.py --dynamo-python /work/dynvenv/bin/python --plane nats --workdir DIR

Started here, all on 127.0.0.1, stopped by PID at the end: etcd, nats-server (with JetStream), kvrouter's selection
service (``--discovery-backend etcd --event-plane PLANE``), ``python -m dynamo.mocker`` (a GPU-less engine that
publishes real KV events) and ``python -m dynamo.frontend`` (``--router-mode kv``), over a model directory without
weights built here (a small BPE tokenizer trained with ``tokenizers``). Then: one prompt sent twice through Dynamo's
frontend, and kvrouter's ``/select`` for the prompt's token ids; with NATS, kvrouter stopped, a second prompt sent,
kvrouter started again (JetStream catch-up); a booking on the mocker in kvrouter that no request follows, until
kvrouter takes it out of selection (its KV events are silent), then a prompt that brings it back; the mocker killed
with -9, and how long kvrouter kept it.

The ZMQ plane's publishers bind 0.0.0.0 whatever Dynamo is told: run this inside a network namespace (``unshare -n``,
after ``ip link set lo up``) so nothing listens beyond loopback; the fleet test does.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

LEASE_TTL = 10
PROMPTS = (
    "the quick brown fox jumps over the lazy dog the quick brown fox jumps over the lazy dog hello world this is a "
    "tiny model hello world this is a tiny model the quick brown fox",
    "hello world this is a tiny model the lazy dog jumps over the quick brown fox hello world this is a tiny model "
    "the lazy dog sleeps and the fox runs and the dog sleeps again",
    "this is a tiny model and the quick brown fox sleeps hello world the lazy dog runs over the tiny model and the "
    "fox jumps again over the dog",
)
KV_EVENTS_TIMEOUT = 2  # kvrouter's --kv-events-timeout-secs
MAKE_MODEL = r"""
import json, sys
from pathlib import Path
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
d = Path(sys.argv[1]); d.mkdir(parents=True, exist_ok=True)
tok = Tokenizer(models.BPE(unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
tok.train_from_iterator(["the quick brown fox jumps over the lazy dog " * 20, "hello world this is a tiny model " * 20],
                        trainer)
tok.save(str(d / "tokenizer.json"))
(d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2,
    "num_key_value_heads": 4, "vocab_size": tok.get_vocab_size(), "max_position_embeddings": 4096,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float16"}))
(d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
    "model_max_length": 4096, "tokenizer_class": "PreTrainedTokenizerFast",
    "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"}))
(d / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
for prompt in sys.argv[2:]:
    print(json.dumps(tok.encode(prompt).ids))
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def http(url: str, body: Any = None, timeout: float = 10) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def wait(what: str, check: Any, timeout: float = 120) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            found = check()
            if found:
                return found
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"timed out waiting for {what}")


class Stack:
    def __init__(self, workdir: Path, dynamo_python: str) -> None:
        self.workdir = workdir
        self.dynamo_python = dynamo_python
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        log = (self.workdir / f"{name}.log").open("ab")
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        self.processes[name] = process
        return process

    def stop(self, name: str, sig: int = signal.SIGTERM) -> None:
        process = self.processes.pop(name, None)
        if process is None or process.poll() is not None:
            return
        process.send_signal(sig)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def stop_all(self) -> None:
        for name in list(self.processes)[::-1]:
            self.stop(name)


def run(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    ids = subprocess.run(
        [args.dynamo_python, "-c", MAKE_MODEL, str(workdir / "model"), *PROMPTS],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split("\n")
    tokens = [json.loads(line) for line in ids if line.strip()]
    stack = Stack(workdir, args.dynamo_python)
    etcd_port, peer_port, nats_port, kv_port, fe_port = (free_port() for _ in range(5))
    etcd_url, nats_url = f"http://127.0.0.1:{etcd_port}", f"nats://127.0.0.1:{nats_port}"
    peer = f"http://127.0.0.1:{peer_port}"
    result: dict[str, Any] = {"plane": args.plane}
    try:
        stack.start(
            "etcd",
            [args.etcd, "--name=n1", f"--data-dir={workdir / 'etcd'}", f"--listen-client-urls={etcd_url}",
             f"--advertise-client-urls={etcd_url}", f"--listen-peer-urls={peer}",
             f"--initial-advertise-peer-urls={peer}", f"--initial-cluster=n1={peer}", "--log-level=error"],
        )  # fmt: skip
        stack.start(
            "nats", [args.nats_server, "-a", "127.0.0.1", "-p", str(nats_port), "-js", "-sd", str(workdir / "js")]
        )
        wait("etcd", lambda: urllib.request.urlopen(etcd_url + "/health", timeout=1).status == 200)
        kvrouter = [
            sys.executable, "-m", "kvrouter.api.cli.main", "select-service", "--port", str(kv_port),
            "--data-dir", str(workdir / "kvrouter"), "--discovery-backend", "etcd", "--etcd-endpoints", etcd_url,
            "--event-plane", args.plane, "--nats-server", nats_url, "--kv-events-timeout-secs", str(KV_EVENTS_TIMEOUT),
        ]  # fmt: skip
        kv_url = f"http://127.0.0.1:{kv_port}"
        stack.start("kvrouter", kvrouter)
        wait("kvrouter", lambda: http(kv_url + "/health"))
        dynamo_env = {
            "ETCD_ENDPOINTS": etcd_url,
            "NATS_SERVER": nats_url,
            "ETCD_LEASE_TTL": str(LEASE_TTL),
            "DYN_TCP_RPC_HOST": "127.0.0.1",
            "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
            "DYN_EVENT_PLANE_HOST": "127.0.0.1",
            "DYN_SYSTEM_HOST": "127.0.0.1",
        }
        common = ["--discovery-backend", "etcd", "--request-plane", "tcp", "--event-plane", args.plane]
        stack.start(
            "mocker",
            [args.dynamo_python, "-m", "dynamo.mocker", "--model-path", str(workdir / "model"), "--model-name", "tiny",
             "--block-size", "16", "--num-gpu-blocks-override", "1024", "--speedup-ratio", "10", *common],
            dynamo_env,
        )  # fmt: skip
        workers = wait("the mocker in kvrouter's catalog", lambda: http(kv_url + "/workers"), timeout=180)
        result["discovered"] = [
            {k: w[k] for k in ("worker_id", "model_name", "block_size", "total_kv_blocks", "discovered_by")}
            for w in workers
        ]
        stack.start(
            "frontend",
            [args.dynamo_python, "-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port", str(fe_port),
             "--router-mode", "kv", *common],
            dynamo_env,
        )  # fmt: skip
        fe_url = f"http://127.0.0.1:{fe_port}"
        wait("Dynamo's frontend", lambda: http(fe_url + "/v1/models")["data"], timeout=180)
        result["dynamo_cached_tokens"] = [complete(fe_url, PROMPTS[0]) for _ in range(2)]
        result["select"] = wait("the blocks in kvrouter's index", lambda: cached(kv_url, tokens[0]), timeout=60)
        if args.plane == "nats":
            stack.stop("kvrouter")
            complete(fe_url, PROMPTS[1])  # published while kvrouter is down: JetStream keeps it
            stack.start("kvrouter", kvrouter)
            wait("kvrouter again", lambda: http(kv_url + "/health"))
            result["select_after_restart"] = wait("the caught-up blocks", lambda: cached(kv_url, tokens[1]), timeout=60)
        result["kv_listener"] = http(kv_url + "/workers")[0]["kv_listeners"]["0"]
        result["liveness"] = liveness(kv_url, fe_url, result["discovered"][0]["worker_id"])
        result["kv_events_timeout_seconds"] = KV_EVENTS_TIMEOUT
        killed = time.monotonic()
        stack.stop("mocker", signal.SIGKILL)
        wait("the mocker to leave kvrouter's catalog", lambda: http(kv_url + "/workers") == [], timeout=60)
        result["left_after_kill_seconds"] = round(time.monotonic() - killed, 1)
        result["lease_ttl_seconds"] = LEASE_TTL
    finally:
        stack.stop_all()
    return result


def liveness(kv_url: str, fe_url: str, worker_id: int) -> dict[str, Any]:
    """A booking on the mocker in kvrouter that no request follows (its KV events stay silent): how long until
    kvrouter takes it out of selection; then a prompt through Dynamo's frontend (the mocker stores blocks and says
    so): how long until it is back."""
    booking = {"model_name": "tiny", "reservation_id": "silent", "worker_id": worker_id, "sequence_hashes": [1]}
    http(kv_url + "/reservations", {**booking, "isl_tokens": 16})
    booked = time.monotonic()
    out = wait("the mocker out of kvrouter's selection", lambda: out_of_selection(kv_url), timeout=60)
    found: dict[str, Any] = {"out_after_seconds": round(time.monotonic() - booked, 2), "out": out}
    sent = time.monotonic()
    complete(fe_url, PROMPTS[2])
    wait("the mocker back in kvrouter's selection", lambda: not out_of_selection(kv_url), timeout=60)
    found["back_after_request_seconds"] = round(time.monotonic() - sent, 2)
    metrics = urllib.request.urlopen(kv_url + "/metrics", timeout=10).read().decode()
    found["metrics"] = [line for line in metrics.splitlines() if line.startswith("kvrouter_kv_stream_")]
    return found


def out_of_selection(url: str) -> dict[str, Any] | None:
    shown: dict[str, Any] | None = http(url + "/workers")[0].get("out_of_selection", {}).get("0")
    return shown


def complete(url: str, prompt: str) -> int:
    answer = http(url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 4})
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"] or 0)


def cached(url: str, tokens: list[int]) -> dict[str, Any] | None:
    """kvrouter's /select for ``tokens``, once it reports cached blocks."""
    answer: dict[str, Any] = http(url + "/select", {"model_name": "tiny", "token_ids": tokens})
    return answer if answer["overlap"]["dp"].get("0", 0) > 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dynamo-python", required=True)
    parser.add_argument("--plane", choices=("nats", "zmq"), required=True)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--etcd", default="etcd")
    parser.add_argument("--nats-server", default="nats-server")
    print(json.dumps(run(parser.parse_args())))


if __name__ == "__main__":
    main()
