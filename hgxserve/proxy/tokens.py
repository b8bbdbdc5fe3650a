"""The model's own token ids for a request, as the engine will compute them: tokenizer.json
through the `tokenizers` library, chat requests rendered with tokenizer_config.json's
chat_template in a sandboxed Jinja environment (the template is input, not code we trust).

    tok = PromptTokenizer.load("/var/lib/hgxserve/models/m")   # TokenizerError when unusable
    ids = tok.prompt_ids(body, "chat")                          # TokenizerError on failure

Anything that fails for one request (a template error, content the template cannot render)
raises TokenizerError; the router then matches that request approximately (counted).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from hgxserve.proxy.tokprefix import PrefixCache, fast_ids

# Bounds on what is read from the tokenizer directory: the largest tokenizer.json files in use
# are ~35 MB (Gemma's 256k vocabulary; Llama 3 ~9 MB, DeepSeek ~8 MB); tokenizer_config.json
# with its chat template is under 1 MB (a few are ~200 kB)
MAX_TOKENIZER_BYTES = 64 << 20
MAX_CONFIG_BYTES = 8 << 20
# the rendered prompt of one request (its body is bounded by limits.max_body_bytes already;
# a template that loops over it may not grow it past this)
MAX_RENDERED_CHARS = 64 << 20
# a conversation the prefix cache's exactness is checked on at load (tokprefix)
SAMPLE_CHAT = [
    {"role": "system", "content": "You are a helpful assistant.\n  Answer briefly."},
    {"role": "user", "content": "Hi there, what is  KV cache?"},
    {"role": "assistant", "content": " It keeps attention keys and values.\n"},
    {"role": "user", "content": "And prefix caching? 42 ünïcode"},
]


class TokenizerError(Exception):
    """The tokenizer cannot be loaded, or cannot tokenize this request."""


def _read(path: Path, limit: int) -> bytes:
    try:
        with path.open("rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise TokenizerError(f"{path}: cannot read: {exc.strerror}") from None
    if len(data) > limit:
        raise TokenizerError(f"{path}: larger than {limit} bytes")
    return data


def _token_text(value: Any) -> str:
    """bos_token / eos_token: a string, or an AddedToken object {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _chat_template(config: dict[str, Any]) -> str | None:
    """tokenizer_config.json's chat_template: a string, or a list of {name, template} of which
    the one named "default"."""
    tpl = config.get("chat_template")
    if isinstance(tpl, list):
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default")
    return tpl if isinstance(tpl, str) else None


class PromptTokenizer:
    """One model's tokenizer and chat template, loaded once per process."""

    def __init__(self, tokenizer: Any, config: dict[str, Any]) -> None:
        self.tokenizer = tokenizer
        self.bos = _token_text(config.get("bos_token"))
        self.eos = _token_text(config.get("eos_token"))
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        source = _chat_template(config)
        try:
            self.template = env.from_string(source) if source else None
        except TemplateError as exc:
            raise TokenizerError(f"chat_template does not compile: {exc}") from None
        self.prefix: PrefixCache | None = None
        try:
            sample = self.render_chat({"messages": SAMPLE_CHAT})
        except TokenizerError:
            return  # a template this sample does not suit: whole encodes
        self.prefix = PrefixCache.for_tokenizer(tokenizer, source, sample)

    @classmethod
    def load(cls, directory: str) -> PromptTokenizer:
        """tokenizer.json (required) and tokenizer_config.json (optional) from `directory`."""
        from tokenizers import Tokenizer  # the proxy without a tokenizer never loads it

        root = Path(directory)
        try:
            tokenizer = Tokenizer.from_str(_read(root / "tokenizer.json", MAX_TOKENIZER_BYTES)
                                           .decode())  # fmt: skip
        except (ValueError, Exception) as exc:  # tokenizers raises plain Exception
            if isinstance(exc, TokenizerError):
                raise
            raise TokenizerError(f"{root / 'tokenizer.json'}: not a tokenizer: {exc}") from None
        config: dict[str, Any] = {}
        if (root / "tokenizer_config.json").exists():
            try:
                loaded = json.loads(_read(root / "tokenizer_config.json", MAX_CONFIG_BYTES))
            except ValueError as exc:
                raise TokenizerError(f"tokenizer_config.json: invalid JSON: {exc}") from None
            config = loaded if isinstance(loaded, dict) else {}
        return cls(tokenizer, config)

    def render_chat(self, body: dict[str, Any]) -> str:
        """The chat request's prompt text, as the engine's chat template renders it."""
        if self.template is None:
            raise TokenizerError("the tokenizer directory has no chat_template")
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise TokenizerError("messages is not a list")
        try:
            text = self.template.render(
                messages=messages,
                tools=body.get("tools"),
                add_generation_prompt=body.get("add_generation_prompt", True),
                bos_token=self.bos,
                eos_token=self.eos,
                **(body.get("chat_template_kwargs") or {}),
            )
        except (TemplateError, TypeError, ValueError, AttributeError, KeyError) as exc:
            raise TokenizerError(f"chat_template failed: {exc}") from None
        if len(text) > MAX_RENDERED_CHARS:
            raise TokenizerError("the rendered prompt is too long")
        return text

    def encode(self, text: str, special: bool) -> list[int]:
        return fast_ids(self.tokenizer, text, special)

    def prompt_ids(self, body: dict[str, Any], endpoint: str) -> list[int]:
        """The request's prompt token ids: chat rendered and tokenized without added special
        tokens (the template writes them), a completion prompt with them, token ids as given."""
        if endpoint == "chat":
            text = self.render_chat(body)
            if self.prefix is not None:
                return self.prefix.encode(text)
            return self.encode(text, special=False)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            return self.encode(prompt, special=True)
        if isinstance(prompt, list) and all(type(t) is int for t in prompt):
            return prompt
        raise TokenizerError("the prompt is neither a string nor token ids")
