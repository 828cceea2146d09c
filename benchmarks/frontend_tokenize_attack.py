"""Large prompts against ``kvrouter frontend``: do they stall other clients?

    python benchmarks/frontend_tokenize_attack.py [--python PY] [--concurrent 1,8,16] [--prompt-mb 7.8]
        [--tokenizer FILE | --model-path DIR [--make-model]]

Two mock workers register with one frontend (subprocesses, journal in memory, the built-in tokenizer unless
``--tokenizer`` names a tokenizer.json or ``--model-path`` a model directory; ``--make-model`` first writes one there:
a 300-token byte-level BPE trained on this docstring, its chat template writing the BOS token). Worker A serves model
``mock`` and streams one long completion to a
"victim" client (a token every few milliseconds); worker B serves model ``big`` and refuses any body over 1 KiB,
so what the attack costs is the frontend's own work. For each row, while the victim streams, ``N`` clients post
a text prompt of ``--prompt-mb`` MB to model ``big`` at once (with ``--model-path``, a chat of one message: it is
rendered with the model's template, then tokenized), and a prober sends ``GET /health`` every 20 ms.
Printed per row: the attack's answers by status (``dropped``: the connection closed without one; ``probe-dropped``:
a ``/health`` probe's did), how long it lasted, the victim's worst gap between two chunks
during it (its normal gap is shown first), and ``/health`` latency p50 / p99 / max during it.

``--python`` runs the servers with another interpreter (a baseline checkout's venv) for before/after figures.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import orjson
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import free_port
from frontend_bench import load, percentile, start, stop

VICTIM = {"model": "mock", "prompt": "Tell me a long story.", "max_tokens": 3000, "stream": True}


async def attack_row(url: str, concurrent: int, prompt: bytes) -> str:
    gaps: list[tuple[float, float]] = []  # (time the chunk arrived, gap before it)
    probes: list[tuple[float, float]] = []
    window: list[float] = []
    statuses: Counter[int] = Counter()
    done = trio.Event()
    async with httpx.AsyncClient(base_url=url, timeout=120, trust_env=False) as http:

        async def victim(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            async with http.stream("POST", "/v1/completions", json=VICTIM) as response:
                last = None
                async for _ in response.aiter_raw():
                    now = time.perf_counter()
                    if last is None:
                        task_status.started()
                    else:
                        gaps.append((now, now - last))
                    last = now

        async def prober() -> None:
            while not done.is_set():
                sent = time.perf_counter()
                try:
                    await http.get("/health")
                except httpx.TransportError:  # a pooled connection the frontend closed as idle while it was frozen
                    statuses[-1] += 1
                probes.append((sent, time.perf_counter() - sent))
                await trio.sleep(0.02)

        async def attacker() -> None:
            route = "/v1/chat/completions" if b'"messages"' in prompt[:40] else "/v1/completions"
            try:
                response = await http.post(route, content=prompt, headers={"content-type": "application/json"})
            except httpx.TransportError:
                statuses[0] += 1  # dropped
                return
            statuses[response.status_code] += 1

        async with trio.open_nursery() as nursery:
            await nursery.start(victim)
            await trio.sleep(0.5)
            nursery.start_soon(prober)
            await trio.sleep(0.3)
            window.append(time.perf_counter())
            async with trio.open_nursery() as attacks:
                for _ in range(concurrent):
                    attacks.start_soon(attacker)
            window.append(time.perf_counter())
            await trio.sleep(0.3)
            done.set()
            nursery.cancel_scope.cancel()
    began, ended = window
    normal = [gap for at, gap in gaps if at < began]
    during = [gap for at, gap in gaps if began <= at <= ended + 0.3] or [0.0]
    health = [took for at, took in probes if began <= at <= ended] or [0.0]
    names = {0: "dropped", -1: "probe-dropped"}
    answers = " ".join(f"{names.get(status, status)}x{count}" for status, count in sorted(statuses.items()))
    return (
        f"{concurrent:>4} {answers:>14} {ended - began:>8.2f} {percentile(normal, 0.5) * 1000:>9.1f} "
        f"{max(during) * 1000:>10.1f} {percentile(health, 0.5) * 1000:>9.1f} {percentile(health, 0.99) * 1000:>9.1f} "
        f"{max(health) * 1000:>9.1f}"
    )


def make_model(path: Path) -> None:
    """A model directory without weights: a byte-level BPE of 300 tokens, a template writing the BOS token."""
    import tokenizers

    path.mkdir(parents=True, exist_ok=True)
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator([__doc__ or "", VICTIM["prompt"]], trainer)
    tokenizer.save(str(path / "tokenizer.json"))
    template = (
        "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}"
        "\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "chat_template": template}
    (path / "tokenizer_config.json").write_text(orjson.dumps(config).decode())
    (path / "config.json").write_text('{"model_type": "llama"}')


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--python", default=sys.executable, help="the interpreter that runs the servers")
    parser.add_argument("--concurrent", default="1,8,16", help="attack sizes, one row each")
    parser.add_argument("--prompt-mb", type=float, default=7.8, help="each attacking prompt's size in MB")
    parser.add_argument("--tokenizer", help="a Hugging Face tokenizer.json for the frontend (default: built-in)")
    parser.add_argument("--model-path", help="a Hugging Face model directory for the frontend (the attack sends chats)")
    parser.add_argument("--make-model", action="store_true", help="first write a small model to --model-path")
    parser.add_argument("--trace", metavar="OUT.json", help="record the frontend's long loop steps (loop_trace.py)")
    parser.add_argument("--frontend-flags", default="", help="more frontend flags, space-separated")
    args = parser.parse_args()
    kvrouter = [args.python, "-m", "kvrouter.api.cli.main"]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    flags = ["--port", str(port), "--log-level", "error", *args.frontend_flags.split()]
    if args.tokenizer:
        flags += ["--tokenizer", args.tokenizer]
    if args.model_path:
        if args.make_model:
            make_model(Path(args.model_path))
        flags += ["--model-path", args.model_path]
    words = int(args.prompt_mb * 1_000_000) // 6
    if args.model_path:
        messages = [{"role": "user", "content": "token " * words}]
        prompt = orjson.dumps({"model": "big", "messages": messages, "max_tokens": 1})
    else:
        prompt = orjson.dumps({"model": "big", "prompt": "token " * words, "max_tokens": 1})
    print(f"servers: {args.python}; {load()} ({os.cpu_count()} cores)")
    processes: list[subprocess.Popen[bytes]] = []
    try:
        frontend = [*kvrouter, "frontend", *flags]
        if args.trace:
            frontend[1:1] = [str(Path(__file__).resolve().parent / "loop_trace.py"), args.trace]
        processes.append(start(frontend, port))
        for model, speedup, extra in (("mock", "4", []), ("big", "1000", ["--max-body-bytes", "1024"])):
            worker_port = free_port()
            worker = [*kvrouter, "mock-worker", "--port", str(worker_port), "--kv-events-port", str(free_port())]
            worker += ["--model-name", model, "--speedup", speedup, "--register", url, "--log-level", "error", *extra]
            processes.append(start(worker, worker_port))
        with httpx.Client(base_url=url, trust_env=False) as http:
            deadline = time.monotonic() + 30
            while len(http.get("/v1/models").json()["data"]) < 2 and time.monotonic() < deadline:
                time.sleep(0.1)
        print(f"{len(prompt) / 1e6:.1f} MB prompts to model big while a stream of model mock runs")
        print(
            f"{'N':>4} {'answers':>14} {'attack s':>8} {'gap p50ms':>9} {'worst gap':>10} "
            f"{'health p50':>9} {'p99 ms':>9} {'max ms':>9}"
        )
        for concurrent in (int(n) for n in args.concurrent.split(",")):
            print(trio.run(attack_row, url, concurrent, prompt), flush=True)
        print(f"after: {load()}")
    finally:
        for process in reversed(processes):
            stop(process)
    return 0


if __name__ == "__main__":
    sys.exit(main())
