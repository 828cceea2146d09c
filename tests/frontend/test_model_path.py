"""``kvrouter frontend --model-path DIR``: a chat is rendered with the model's own template and tokenized with its
``tokenizer.json``, so the ids the frontend routes with (and hashes into blocks) are the engine's. The model directory
is built in the test: a small BPE trained with ``tokenizers`` on a few sentences, a template writing the BOS token."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from kvrouter.actors.core.router_config import RouterConfig
from kvrouter.api.frontend.cli import build_parser, main, options_from
from kvrouter.api.openai.body import Refusal
from tests.support.frontends import small_limits, start_frontend, start_workers

tokenizers = pytest.importorskip("tokenizers")
jinja2_sandbox = pytest.importorskip("jinja2.sandbox")

SENTENCES = [
    "the router sends each request to the worker whose cache holds its prefix",
    "a block of tokens is hashed with the hash of the block before it",
    "hello there, how are you today? I am well, thank you for asking",
    "system prompts are shared by many requests and cached once",
]
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('roles are system, user and assistant') }}{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "You are a helpful router."},
    {"role": "user", "content": "hello there, which worker holds the prefix of this request?"},
]


def model_dir(path: Path, template: str | None = TEMPLATE) -> Path:
    """A model directory without weights: a trained BPE ``tokenizer.json``, its config with the template, a config."""
    path.mkdir()
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(SENTENCES, trainer)
    tokenizer.save(str(path / "tokenizer.json"))
    config: dict[str, Any] = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 4096,
    }
    if template is not None:
        config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    return path


def expected_chat_ids(path: Path, messages: list[dict[str, str]]) -> list[int]:
    """The ids an engine computes: the template rendered as transformers renders it, tokenized without adding
    special tokens (the template wrote the BOS)."""
    environment = jinja2_sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    text = environment.from_string(TEMPLATE).render(
        messages=messages, add_generation_prompt=True, bos_token="<s>", eos_token="</s>"
    )
    tokenizer = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    return list(tokenizer.encode(text, add_special_tokens=False).ids)


async def test_a_chat_is_routed_with_the_ids_of_the_models_template(nursery: trio.Nursery, tmp_path: Path) -> None:
    path = model_dir(tmp_path / "model")
    expected = expected_chat_ids(path, MESSAGES)
    bos = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json")).token_to_id("<s>")
    assert expected[0] == bos and expected.count(bos) == 1  # the BOS once: the template's, none added again
    # No KV events: the frontend predicts each worker's cache from the ids it routed with.
    frontend = await start_frontend(nursery, model_path=path, router=RouterConfig(use_kv_events=False))
    await start_workers(nursery, frontend, 1)
    request = await frontend.proxy.tokenizing.request({"messages": MESSAGES}, chat=True, model="mock")
    assert request.prompt == expected
    long = [{"role": "user", "content": " ".join(SENTENCES * 40)}]  # past INLINE_CHARS: on a tokenizer thread
    request = await frontend.proxy.tokenizing.request({"messages": long}, chat=True, model="mock")
    assert request.prompt == expected_chat_ids(path, long)
    async with httpx.AsyncClient(base_url=frontend.url, timeout=10) as http:
        answer = await http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2})
        assert answer.status_code == 200, answer.text
        # The blocks booked for that chat are the blocks of the template's ids: a selection for them finds all.
        chosen = await http.post("/select", json={"model_name": "mock", "tenant_id": "default", "token_ids": expected})
        assert chosen.status_code == 200, chosen.text
        assert chosen.json()["overlap"]["dp"]["0"] == len(expected) // 4 * 4, chosen.json()


async def test_a_completion_gets_the_bos_token_the_config_asks_for(nursery: trio.Nursery, tmp_path: Path) -> None:
    path = model_dir(tmp_path / "model")
    tokenizer = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    frontend = await start_frontend(nursery, model_path=path)
    await start_workers(nursery, frontend, 1)
    request = await frontend.proxy.tokenizing.request({"prompt": SENTENCES[0]}, chat=False, model="mock")
    assert request.prompt == [
        tokenizer.token_to_id("<s>"),
        *tokenizer.encode(SENTENCES[0], add_special_tokens=False).ids,
    ]


async def test_a_template_that_raises_or_runs_away_refuses_the_request(nursery: trio.Nursery, tmp_path: Path) -> None:
    path = model_dir(tmp_path / "model")
    frontend = await start_frontend(nursery, model_path=path)
    await start_workers(nursery, frontend, 1)
    async with httpx.AsyncClient(base_url=frontend.url, timeout=10) as http:
        answer = await http.post("/v1/chat/completions", json={"messages": [{"role": "tool", "content": "x"}]})
        assert answer.status_code == 400
        assert answer.json() == {
            "error": "the model's chat template refused these messages: roles are system, user and assistant"
        }
    runaway = model_dir(tmp_path / "runaway", "{% for i in range(100000) %}{{ messages[0]['content'] }}{% endfor %}")
    frontend = await start_frontend(nursery, model_path=runaway, limits=small_limits(max_prompt_tokens=1000))
    with pytest.raises(Refusal) as refused:
        await frontend.proxy.tokenizing.request({"messages": MESSAGES}, chat=True, model="mock")
    assert refused.value.response.status == 400
    assert b"rendered more than 16000 bytes" in refused.value.response.body


async def test_images_and_n_above_one_are_not_refused_by_the_frontend(nursery: trio.Nursery) -> None:
    """Only the mock worker refuses what it cannot answer; a real worker gets the body unchanged."""
    frontend = await start_frontend(nursery)
    await start_workers(nursery, frontend, 1)
    parts = [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "data:,"}}]
    async with httpx.AsyncClient(base_url=frontend.url, timeout=10) as http:
        for route, body in (
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": parts}], "max_tokens": 2}),
            ("/v1/completions", {"prompt": "hello", "n": 3, "max_tokens": 2}),
        ):
            answer = await http.post(route, json=body)
            assert answer.status_code == 400, answer.text
            assert answer.headers.get("x-kvrouter-worker-id") == "1", (answer.headers, answer.text)  # forwarded
            assert "mock worker" in answer.json()["error"] or "only text parts" in answer.json()["error"]


@pytest.mark.parametrize(
    ("make", "text"),
    [
        (lambda tmp: tmp / "absent", "no such directory"),
        (lambda tmp: (tmp / "empty").mkdir() or tmp / "empty", "no tokenizer.json in it"),
        (
            lambda tmp: model_dir(tmp / "bad", "{% for m in messages %}{{ m['content'] }"),
            "chat template does not compile",
        ),
    ],
)
def test_a_bad_model_path_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture, tmp_path: Path, make: Any, text: str
) -> None:
    path = make(tmp_path)
    status = main(["--model-path", str(path)])
    assert status == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    lines += [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]
    assert len(lines) == 1 and f"--model-path {path}" in lines[0] and text in lines[0], lines


def test_the_ids_equal_transformers_apply_chat_template(tmp_path: Path) -> None:
    """Optional: where ``transformers`` is installed, its ``apply_chat_template`` gives the same ids."""
    transformers = pytest.importorskip("transformers")
    from kvrouter.api.frontend.model_dir import load_model_dir

    path = model_dir(tmp_path / "model")
    model = load_model_dir(path)
    ours = model.chat_ids(model.render_chat({"messages": MESSAGES}, 1 << 20))
    theirs = transformers.AutoTokenizer.from_pretrained(str(path)).apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True
    )
    if not isinstance(theirs, list):  # newer releases answer a BatchEncoding
        theirs = theirs["input_ids"]
    assert ours == list(theirs)


async def test_a_model_without_a_template_warns_once_and_refuses_chats(
    nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = model_dir(tmp_path / "model", template=None)
    with caplog.at_level(logging.WARNING):
        options_from(build_parser().parse_args(["--model-path", str(path)]), {})
    assert [record.getMessage() for record in caplog.records] == [
        f"the model at {path} has no chat template (tokenizer_config.json chat_template or chat_template.jinja): "
        "chat requests are refused, send /v1/completions with the prompt text"
    ]
    frontend = await start_frontend(nursery, model_path=path)
    with pytest.raises(Refusal) as refused:
        await frontend.proxy.tokenizing.request({"messages": MESSAGES}, chat=True, model="mock")
    assert refused.value.response.status == 400 and b"has no chat template" in refused.value.response.body
    assert (await frontend.proxy.tokenizing.request({"prompt": "hello"}, chat=False, model="mock")).prompt


HOSTILE_TEMPLATES = {
    # each loop within jinja2's own MAX_RANGE: only a step or time budget stops it (it used to hold a thread for hours)
    "nested loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}ok",
    # jinja2 folds constants when it compiles: this built 10 GB before the frontend could start
    "constant repeat": "{% set s = 'x' * 10**10 %}{{ s|length }}",
    "filter width": "{{ 'x'|center(10**10) }}",
    "huge power": "{{ 7**10000000 }}",
    "format width": "{{ '%0999999999d' % 1 }}",
    "repeat of a message": "{% set s = messages[0]['content'] * 100000000 %}{{ s|length }}",
    "loops over the messages": "{% for a in messages %}{% for b in messages %}{% for c in messages %}"
    "{% endfor %}{% endfor %}{% endfor %}",
}


@pytest.mark.parametrize("template", HOSTILE_TEMPLATES.values(), ids=HOSTILE_TEMPLATES.keys())
def test_a_hostile_template_loads_and_refuses_the_request_within_its_bounds(tmp_path: Path, template: str) -> None:
    from kvrouter.api.frontend.model_dir import ChatRefused, load_model_dir
    from kvrouter.api.frontend.template_sandbox import RENDER_SECONDS

    model = load_model_dir(model_dir(tmp_path / "m", template))  # compiling it builds nothing
    messages = [{"role": "user", "content": "hi"}] * 400
    started = time.monotonic()
    with pytest.raises(ChatRefused, match="chat template"):
        model.render_chat({"messages": messages}, 1 << 24)
    assert time.monotonic() - started < RENDER_SECONDS * 5  # the budget stopped it, not its end


def test_the_bounds_leave_an_ordinary_template_alone(tmp_path: Path) -> None:
    from kvrouter.api.frontend.model_dir import load_model_dir

    model = load_model_dir(model_dir(tmp_path / "m"))
    assert model.chat_ids(model.render_chat({"messages": MESSAGES}, 1 << 20)) == expected_chat_ids(
        tmp_path / "m", MESSAGES
    )
