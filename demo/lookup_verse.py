"""The demo model's tool, end to end: offer `lookup_verse`, run the call, send the result back.

The bundled demo model learned one function tool, `lookup_verse(book, chapter, verse)` over the
World English Bible (public domain). This script is the client side of that loop with the `openai`
package against `hybridmoe serve`:

    hybridmoe serve --port 8080 &
    python demo/lookup_verse.py "What does John 3:16 say?"

It prints the model's tool call, the tool's result (read from demo/web_verses.tsv.xz, which
demo/corpus.py extracts from Debian's sword-text-web) and the model's final answer.
"""
from __future__ import annotations

import argparse
import json
import lzma
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
VERSES = HERE / "web_verses.tsv.xz"
# The declaration clients send; the corpus renders exactly this, so the model recognises it.
LOOKUP_VERSE_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "lookup_verse",
        "description": "Look up one verse of the World English Bible.",
        "parameters": {
            "type": "object",
            "properties": {
                "book": {"type": "string", "description": "Book name, e.g. John or Psalms"},
                "chapter": {"type": "integer"},
                "verse": {"type": "integer"},
            },
            "required": ["book", "chapter", "verse"],
        },
    },
}
ALIASES = {"psalm": "Psalms", "song of songs": "Song of Solomon", "revelations": "Revelation"}


@lru_cache(maxsize=1)
def load_verses(path: Path = VERSES) -> dict[tuple[str, int, int], str]:
    """{(book, chapter, verse): text}, books keyed in lower case."""
    table: dict[tuple[str, int, int], str] = {}
    with lzma.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            book, chapter, verse, text = line.rstrip("\n").split("\t")
            table[(book.lower(), int(chapter), int(verse))] = text
    return table


def canonical_book(book: str) -> str:
    name = " ".join(str(book).split()).lower()
    return ALIASES.get(name, name).lower()


def lookup_verse(book: str, chapter: Any, verse: Any) -> str:
    """The tool: the verse text, or a short error the model can relay."""
    try:
        key = (canonical_book(book), int(chapter), int(verse))
    except (TypeError, ValueError):
        return "Error: chapter and verse must be numbers."
    return load_verses().get(key, f"Error: no verse {book} {chapter}:{verse} in the World English Bible.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("question", nargs="?", default="What does John 3:16 say?")
    ap.add_argument("--base-url", default="http://127.0.0.1:8080/v1")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from openai import OpenAI

    client = OpenAI(base_url=args.base_url, api_key="none")
    messages: list[dict[str, Any]] = [{"role": "user", "content": args.question}]
    tools = [LOOKUP_VERSE_TOOL]
    first = client.chat.completions.create(model="demo", messages=messages, tools=tools, seed=args.seed,
                                           max_tokens=200)
    msg = first.choices[0].message
    if not msg.tool_calls:
        print("no tool call; the model answered:", msg.content)
        sys.exit(1)
    call = msg.tool_calls[0]
    print(f"tool call: {call.function.name}({call.function.arguments})")
    try:
        result = lookup_verse(**json.loads(call.function.arguments))
    except (json.JSONDecodeError, TypeError) as e:
        result = f"Error: bad arguments ({e})."
    print("tool result:", result)
    messages.append({"role": "assistant", "content": msg.content,
                     "tool_calls": [{"id": call.id, "type": "function",
                                     "function": {"name": call.function.name, "arguments": call.function.arguments}}]})
    messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    final = client.chat.completions.create(model="demo", messages=messages, tools=tools, seed=args.seed,
                                           max_tokens=200)
    print("answer:", final.choices[0].message.content)


if __name__ == "__main__":
    main()
