"""The frames between the server's two processes (`openai_api.wire`): what an `Outbox` puts
a `FrameReader` reads back whole and in order, across partial sends and reads."""

from __future__ import annotations

from graphdraft.serving.openai_api.wire import FrameReader, Outbox, encode, socket_pair


def test_frames_round_trip_across_partial_sends():
    a, b = socket_pair()
    a.setblocking(False)
    b.setblocking(False)
    out, reader = Outbox(a), FrameReader(b)
    messages = [("out", [(i, list(range(i * 3)), None, None, None) for i in range(40)], None),
                ("log", 20, "x" * 5_000_000),  # beyond the socket buffers: partial sends
                ("add", [(7, [1, 2, 3], {"max_new_tokens": 4}, None)]), ("exit",)]
    for m in messages:
        out.put(m)
    got = []
    for _ in range(10_000):
        done = out.flush()
        got += reader.read()
        if done and len(got) == len(messages):
            break
    assert got == messages and not out
    framed = Outbox(a)
    framed.put(messages[2])
    assert bytes(framed._buf) == encode(messages[2])  # the framing `encode` documents
    a.close()
    b.close()


def test_stream_chunks_encode_the_same_bytes_as_the_whole_body():
    """`protocol.ChunkEncoder` encodes a stream's envelope once: each event equals encoding
    the whole chunk body (with and without include_usage, non-ASCII text, a final usage)."""
    import json

    from graphdraft.serving.openai_api import protocol as P

    for chat in (False, True):
        for include_usage in (False, True):
            enc = P.ChunkEncoder("cmpl-1", "mod\u00e8le", chat, 123, include_usage)
            choices = [P.choice(0, "h\u00e9llo\n\"x\"", None, chat, delta=True),
                       P.choice(1, "", "stop", chat, delta=True)]
            body = P.envelope("cmpl-1", "mod\u00e8le", chat, chunk=True, created=123)
            body["choices"] = choices
            if include_usage:
                body["usage"] = None
            assert enc(choices) == "data: " + json.dumps(body, ensure_ascii=False) + "\n\n"
            last = json.loads(enc([], usage={"total_tokens": 3})[6:])
            assert last["usage"] == {"total_tokens": 3} and last["choices"] == []
            assert list(last)[-2:] == ["choices", "usage"]
