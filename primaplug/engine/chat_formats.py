"""The chat format of a GGUF that carries no chat template.

llama-cpp-python uses a model's own template (`tokenizer.chat_template`) and, without one, falls back to llama-2's
format, which models trained on another format answer with nothing or with noise. Here the format is chosen from the
tokenizer's special tokens, which name the format they were trained on (Gemma's `<start_of_turn>`, Llama 3's
`<|start_header_id|>`, ChatML's `<|im_start|>`, ...), and failing that from the architecture. A template in the file
always wins, as in llama-cpp-python, and so does a format the user names (`--chat-format`, `chat_format=`).

llama-cpp-python has no Phi-3 nor gpt-oss (harmony) format: both are registered here under the names `phi-3` and
`gpt-oss`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import llama_cpp.llama_chat_format as _formats
from llama_cpp.llama_chat_format import ChatFormatterResponse

# (format, special tokens that must each be one token of the vocabulary), most specific first: Phi-3's `<|end|>` is
# also harmony's, so harmony, which has more, is asked first
MARKERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("gpt-oss", ("<|start|>", "<|channel|>", "<|message|>", "<|end|>")),
    ("llama-3", ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")),
    ("phi-3", ("<|user|>", "<|assistant|>", "<|end|>")),
    ("chatml", ("<|im_start|>", "<|im_end|>")),
    ("gemma", ("<start_of_turn>", "<end_of_turn>")),
    ("mistral-instruct", ("[INST]", "[/INST]")),
)
# where the tokenizer names none (a synthetic vocabulary, a converted file that lost its specials): the format the
# architecture's instruction-tuned models use; architectures whose format llama-cpp-python lacks are left out
BY_ARCH = {
    "gemma2": "gemma", "gemma3": "gemma", "gemma4": "gemma", "gpt-oss": "gpt-oss", "phi3": "phi-3",
    "qwen2": "chatml", "qwen3": "chatml", "qwen3moe": "chatml", "qwen35": "chatml", "qwen35moe": "chatml",
    "qwen3next": "chatml", "lfm2": "chatml", "lfm2moe": "chatml", "olmo2": "chatml", "mistral3": "mistral-instruct",
    "llama4": "llama-3",
}
DEFAULT = "llama-2"  # llama-cpp-python's own fallback


def choose_chat_format(arch: str, has_template: bool,
                       is_special: Callable[[str], bool]) -> tuple[str | None, str]:
    """The chat format for a model, and why: None where its own template is to be used. `is_special(text)` tells
    whether text is one special token of the model's vocabulary."""
    if has_template:
        return None, "the model's own chat template (tokenizer.chat_template)"
    for name, tokens in MARKERS:
        if all(is_special(t) for t in tokens):
            return name, f"the file has no chat template; its tokenizer has {', '.join(tokens)}"
    if arch in BY_ARCH:
        return BY_ARCH[arch], (f"the file has no chat template and its tokenizer no known turn markers; "
                               f"'{arch}' models are tuned on it")
    return DEFAULT, (f"the file has no chat template, its tokenizer no known turn markers, and '{arch}' models no "
                     "one format: llama-cpp-python's default; pass --chat-format (chat_format=) to choose one")


def _turns(messages: list[Any]) -> list[tuple[str, str]]:
    return [(m["role"], m["content"] if isinstance(m.get("content"), str) else "") for m in messages]


@_formats.register_chat_format("phi-3")
def format_phi3(messages: list[Any], **kwargs: Any) -> ChatFormatterResponse:  # noqa: ARG001
    """Phi-3 and Phi-4 mini: `<|role|>` newline text `<|end|>`, then the assistant's turn opened."""
    prompt = "".join(f"<|{role}|>\n{text}<|end|>\n" for role, text in _turns(messages)
                     if role in ("system", "user", "assistant"))
    return ChatFormatterResponse(prompt=prompt + "<|assistant|>\n", stop=["<|end|>", "<|endoftext|>"])


@_formats.register_chat_format("gpt-oss")
def format_harmony(messages: list[Any], **kwargs: Any) -> ChatFormatterResponse:  # noqa: ARG001
    """gpt-oss's harmony format: `<|start|>role<|message|>text<|end|>` per message (the system prompt as the
    developer's), then the assistant's turn opened in its final channel, so that the reply is the answer itself
    rather than its analysis channel first."""
    prompt = ""
    for role, text in _turns(messages):
        role = {"system": "developer", "tool": "functions"}.get(role, role)
        prompt += f"<|start|>{role}<|message|>{text}<|end|>"
    return ChatFormatterResponse(prompt=prompt + "<|start|>assistant<|channel|>final<|message|>",
                                 stop=["<|end|>", "<|return|>", "<|call|>"])
