"""The chat format of a GGUF without a chat template: chosen from its tokenizer's turn markers, else from its
architecture; a template in the file always wins; and each chosen format renders prompts in that format."""

from __future__ import annotations

from collections.abc import Callable

import llama_cpp.llama_chat_format as formats
import pytest

from primaplug.engine import SUPPORTED_ARCHS
from primaplug.engine.chat_formats import DEFAULT, MARKERS, choose_chat_format, format_harmony, format_phi3

# what each architecture windows support gets where the tokenizer names no format: the format its
# instruction-tuned models are trained on, or llama-cpp-python's default where they have none of its formats
EXPECTED_BY_ARCH = {
    "llama": DEFAULT, "llama4": "llama-3", "qwen2": "chatml", "qwen3": "chatml", "qwen3moe": "chatml",
    "qwen35": "chatml", "qwen35moe": "chatml", "qwen3next": "chatml", "gpt-oss": "gpt-oss", "glm4moe": DEFAULT,
    "mistral3": "mistral-instruct", "granite": DEFAULT, "gemma3": "gemma", "gemma2": "gemma", "gemma4": "gemma",
    "olmo2": "chatml", "phi3": "phi-3", "lfm2": "chatml", "lfm2moe": "chatml", "deepseek2": DEFAULT,
    "minimax-m2": DEFAULT, "kimi-linear": DEFAULT, "deepseek32": DEFAULT,
    "glm-dsa": DEFAULT,
}
RENDER = {"gpt-oss": format_harmony, "llama-3": formats.format_llama3, "phi-3": format_phi3,
          "chatml": formats.format_chatml, "gemma": formats.format_gemma,
          "mistral-instruct": formats.format_mistral_instruct}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another?"}]


def vocabulary(*specials: str) -> Callable[[str], bool]:
    return lambda text: text in specials


def test_every_supported_architecture_has_its_format() -> None:
    assert set(EXPECTED_BY_ARCH) == set(SUPPORTED_ARCHS)
    for arch, want in EXPECTED_BY_ARCH.items():
        chosen, why = choose_chat_format(arch, False, vocabulary())
        assert chosen == want, (arch, why)
        assert ("--chat-format" in why) == (want == DEFAULT)


@pytest.mark.parametrize(("name", "tokens"), MARKERS)
def test_the_tokenizers_turn_markers_choose_whatever_the_architecture(name: str, tokens: tuple[str, ...]) -> None:
    chosen, why = choose_chat_format("llama", False, vocabulary(*tokens))
    assert chosen == name and all(t in why for t in tokens)


def test_harmony_is_not_taken_for_phi3_whose_end_token_it_shares() -> None:
    assert choose_chat_format("llama", False, vocabulary("<|user|>", "<|assistant|>", "<|end|>"))[0] == "phi-3"
    harmony = vocabulary("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|user|>", "<|assistant|>")
    assert choose_chat_format("gpt-oss", False, harmony)[0] == "gpt-oss"


def test_a_template_in_the_file_always_wins() -> None:
    chosen, why = choose_chat_format("gemma3", True, vocabulary("<start_of_turn>", "<end_of_turn>"))
    assert chosen is None and "own chat template" in why


@pytest.mark.parametrize(("name", "tokens"), MARKERS)
def test_each_format_renders_its_own_turns(name: str, tokens: tuple[str, ...]) -> None:
    """The prompt a chosen format renders is in that format: every turn marker the format writes is there (the
    model writes the rest: harmony's channel is opened here, Llama 3's end of turn closes each message)."""
    rendered = RENDER[name](MESSAGES)
    assert "Name a colour." in rendered.prompt and "Another?" in rendered.prompt
    assert all(t in rendered.prompt for t in tokens), (name, rendered.prompt)
    assert rendered.stop


def test_the_registered_formats_are_llama_cpp_pythons_handlers() -> None:
    registry = formats.LlamaChatCompletionHandlerRegistry()
    for name in RENDER:
        assert registry.get_chat_completion_handler_by_name(name) is not None
    assert format_harmony(MESSAGES).prompt.endswith("<|start|>assistant<|channel|>final<|message|>")
    assert format_phi3(MESSAGES).prompt.startswith("<|system|>\nBe brief.<|end|>\n<|user|>\n")
