"""``--model-path DIR``: tokenize as the model's engine does, from the files of a Hugging Face model directory
(read from disk, never downloaded): ``tokenizer.json`` through the optional ``tokenizers`` package,
``tokenizer_config.json`` (``chat_template``, ``bos_token``/``eos_token``, ``add_bos_token``/``add_eos_token``), a
``chat_template.jinja`` beside it when the config has no template, and ``config.json`` (checked, named in the log).

Why: the router's block hashes come from token ids; they match what an engine caches only if the ids are the
engine's. vLLM, SGLang and Dynamo render a chat with the model's own Jinja template (as transformers'
``apply_chat_template`` does: a sandbox, ``trim_blocks``/``lstrip_blocks``, ``raise_exception``, ``messages``,
``add_generation_prompt=True``, the special tokens as variables) and tokenize the rendered text without adding
special tokens again (the template writes them); a completion's text is tokenized with the special tokens the
tokenizer adds. See ``docs/tokenizing.md``.

A directory that cannot be used (missing, no ``tokenizer.json``, bad JSON, a template that does not compile) is one
line at startup (exit 2). A template that raises for a request's messages, renders past the frontend's prompt bound
or past the bounds of ``template_sandbox.py`` (time, steps, sizes) refuses that request: 400 with ``{"error"}``.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

from kvrouter.api.frontend.template_sandbox import (
    TemplateBudgetExceeded,
    bounded_callable,
    budgeted,
    make_environment,
    start_render,
)
from kvrouter.api.frontend.tokenizers import TokenizerUnavailable, hf_count, hf_ids

MAX_CONFIG_BYTES = 16 * 1024 * 1024  # tokenizer_config.json, config.json, chat_template.jinja: read at most this
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


class ChatRefused(ValueError):
    """The chat template cannot render a request's messages; ``str`` is one line for the 400 answer."""


class ModelTokenizer:
    """A model directory's tokenizer: called with a completion's text (special tokens added as the model's tokenizer
    adds them); ``chat_ids`` renders and tokenizes a chat. The frontend's ``Tokenizing`` tells it from the built-in
    tokenizer by its ``chat_ids``."""

    def __init__(self, path: Path, tokenizer: Any, config: dict[str, Any], template: Any) -> None:
        self.path = path
        self.name = f"model {path}"
        self._tokenizer = tokenizer
        self._template = template  # None: the model has no chat template
        self._specials = {name: _token_text(config.get(name)) for name in SPECIAL_TOKENS}
        self._add_bos = config.get("add_bos_token")
        self._add_eos = config.get("add_eos_token")
        self.template_missing = (
            None
            if template is not None
            else f"the model at {path} has no chat template (tokenizer_config.json chat_template or "
            "chat_template.jinja): chat requests are refused, send /v1/completions with the prompt text"
        )

    def __call__(self, text: str) -> list[int]:
        """A completion's ids. With ``add_bos_token``/``add_eos_token`` in the config those decide (as transformers'
        Llama-style tokenizers rebuild their post-processor from them); otherwise ``tokenizer.json``'s own
        post-processor adds what it adds."""
        if not isinstance(self._add_bos, bool) and not isinstance(self._add_eos, bool):
            return hf_ids(self._tokenizer, text, special_tokens=True)
        ids = hf_ids(self._tokenizer, text, special_tokens=False)
        if self._add_bos is True:
            ids[:0] = self._special_id("bos_token")
        if self._add_eos is True:
            ids.extend(self._special_id("eos_token"))
        return ids

    def _special_id(self, name: str) -> list[int]:
        text = self._specials.get(name)
        found = self._tokenizer.token_to_id(text) if text else None
        return [] if found is None else [int(found)]

    def render_chat(self, body: dict[str, Any], max_bytes: int) -> str:
        """The chat's prompt text from the model's template; ``ChatRefused`` if it has none, raises, or renders more
        than ``max_bytes`` (counted as it renders, so a runaway template stops there)."""
        if self.template_missing is not None:
            raise ChatRefused(self.template_missing)
        variables: dict[str, Any] = {"messages": budgeted(body.get("messages")), "add_generation_prompt": True}
        variables.update(self._specials)
        for name in ("tools", "documents"):
            if isinstance(body.get(name), list):
                variables[name] = budgeted(body[name])
        parts: list[str] = []
        size = 0
        start_render()
        try:
            for chunk in self._template.generate(**variables):
                size += len(chunk.encode("utf-8"))
                if size > max_bytes:
                    raise ChatRefused(
                        f"the model's chat template rendered more than {max_bytes} bytes for these messages "
                        "(the frontend's prompt bound, --max-prompt-tokens x 16)"
                    )
                parts.append(chunk)
        except ChatRefused:
            raise
        except TemplateBudgetExceeded as exc:
            raise ChatRefused(str(exc)) from None
        except Exception as exc:  # jinja2's errors and whatever a template's filters raise
            raise ChatRefused(f"the model's chat template refused these messages: {_one_line(exc)}") from None
        return "".join(parts)

    def chat_ids(self, text: str) -> list[int]:
        """A rendered chat's ids: no special tokens added (the template wrote them), as ``apply_chat_template``."""
        return hf_ids(self._tokenizer, text, special_tokens=False)

    def count(self, text: str) -> int:
        """How many tokens ``text`` has, no special tokens added: a long prompt is counted a slice at a time before
        it is tokenized whole, so one far over ``--max-prompt-tokens`` is refused early (``tokenizing.py``)."""
        return hf_count(self._tokenizer, text)


def load_model_dir(path: Path) -> ModelTokenizer:
    """The tokenizer of the model directory ``path``; ``TokenizerUnavailable`` (one line) if it cannot be used."""
    flag = f"--model-path {path}"
    try:
        from tokenizers import Tokenizer  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        raise TokenizerUnavailable(
            f"{flag}: the 'tokenizers' package is not installed; install kvrouter[hf] (pip install 'kvrouter[hf]')"
        ) from None
    if not path.is_dir():
        raise TokenizerUnavailable(f"{flag}: no such directory (give a Hugging Face model directory)")
    if not (path / "tokenizer.json").is_file():
        raise TokenizerUnavailable(f"{flag}: no tokenizer.json in it (kvrouter reads the fast tokenizer's file)")
    try:
        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    except Exception as exc:  # the library raises its own exception types
        raise TokenizerUnavailable(
            f"{flag}: tokenizer.json is not a Hugging Face tokenizer ({_one_line(exc)})"
        ) from None
    config = _json_object(path / "tokenizer_config.json", flag)
    _json_object(path / "config.json", flag)
    source = config.get("chat_template")
    if source is None and (path / "chat_template.jinja").is_file():
        source = _read(path / "chat_template.jinja", flag)
    template = compile_template(_pick_template(source, flag), flag) if source is not None else None
    return ModelTokenizer(path, tokenizer, config, template)


def _pick_template(source: Any, flag: str) -> str:
    """``chat_template`` is a text, or a list of ``{name, template}`` of which transformers uses ``default``."""
    if isinstance(source, str):
        return source
    if isinstance(source, list):
        named = {item.get("name"): item.get("template") for item in source if isinstance(item, dict)}
        if isinstance(named.get("default"), str):
            return str(named["default"])
    raise TokenizerUnavailable(
        f"{flag}: tokenizer_config.json chat_template must be a text or a list with a 'default' template"
    )


def compile_template(source: str, flag: str) -> Any:
    """The template compiled in jinja2's immutable sandbox with transformers' settings and helpers."""
    try:
        import jinja2
    except ImportError:
        raise TokenizerUnavailable(
            f"{flag}: the 'jinja2' package is not installed; install kvrouter[hf] (pip install 'kvrouter[hf]')"
        ) from None

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    environment = make_environment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    environment.filters["tojson"] = bounded_callable(_tojson)
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = _strftime_now
    try:
        return environment.from_string(source)
    except jinja2.exceptions.TemplateError as exc:
        raise TokenizerUnavailable(f"{flag}: the chat template does not compile ({_one_line(exc)})") from None


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:  # fmt: skip
    """JSON as Python writes it (jinja2's own ``tojson`` escapes HTML characters, which a model never saw)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


def _json_object(path: Path, flag: str) -> dict[str, Any]:
    """A JSON object file of the directory; absent: empty."""
    if not path.is_file():
        return {}
    try:
        found = json.loads(_read(path, flag))
    except ValueError as exc:
        raise TokenizerUnavailable(f"{flag}: {path.name} is not JSON ({_one_line(exc)})") from None
    if not isinstance(found, dict):
        raise TokenizerUnavailable(f"{flag}: {path.name} must hold a JSON object")
    return found


def _read(path: Path, flag: str) -> str:
    try:
        with path.open("rb") as file:
            data = file.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise TokenizerUnavailable(f"{flag}: {path.name} cannot be read ({exc.strerror or exc})") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise TokenizerUnavailable(f"{flag}: {path.name} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise TokenizerUnavailable(f"{flag}: {path.name} is not UTF-8") from None


def _token_text(value: Any) -> str | None:
    """A special token as the config writes it: a text, or an added-token object with its ``content``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."
