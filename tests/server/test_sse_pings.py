"""SSE keep-alive pings (llama-server's --sse-ping-interval / sse_ping_interval): a stream silent
for the interval sends an SSE comment; the events themselves pass through unchanged."""

from __future__ import annotations

import asyncio

from hybridmoe.server.generation import SSE_PING, with_pings


def _collect(stream) -> list[str]:
    async def go() -> list[str]:
        return [x async for x in stream]
    return asyncio.run(go())


async def _slow(items: list[str], pause: float, log: list[str]):
    try:
        for x in items:
            await asyncio.sleep(pause)
            yield x
    finally:
        log.append("closed")


def test_silence_is_filled_with_pings():
    log: list[str] = []
    out = _collect(with_pings(_slow(["data: a\n\n", "data: b\n\n"], 0.4, log), 0.05))
    assert [x for x in out if x != SSE_PING] == ["data: a\n\n", "data: b\n\n"]
    assert out.index("data: a\n\n") >= 1 and out.count(SSE_PING) >= 2  # pings before and between
    assert log == ["closed"]


def test_no_pings_when_off():
    log: list[str] = []
    assert _collect(with_pings(_slow(["x"], 0.1, log), -1)) == ["x"] and log == ["closed"]


def test_a_client_that_leaves_closes_the_stream():
    """The consumer stops mid-silence (a disconnect): the inner stream is closed, so its request
    is cancelled and the slot freed."""
    log: list[str] = []

    async def go() -> list[str]:
        got = []
        agen = with_pings(_slow(["a", "b", "c"], 0.3, log), 0.05)
        async for x in agen:
            got.append(x)
            if x == "a":
                break
        await agen.aclose()
        return got

    got = asyncio.run(go())
    assert got[-1] == "a" and log == ["closed"]
