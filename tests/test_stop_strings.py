"""Stop strings cut exactly (issue #43 item 4): `graphdraft.serving.stop_strings.ChoiceText`,
the one rule of the CLI and the server. A stop string across token boundaries, inside one
token's text, across pushes (verify windows), with a multi-byte character split over tokens;
nothing after it is returned (text, tokens, log-probabilities, usage); the stop string only
with `include_stop_str_in_output`; a stream holds back only what could still start a stop
string, and every split of the same ids into pushes returns the same text. Then the CLI end
to end (`graphdraft generate --json / --json-lines`) on the shipped pair."""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphdraft.io.tokenizer import ByteLevelTokenizer, Tokenizer
from graphdraft.serving.stop_strings import ChoiceText


class WordTokenizer(Tokenizer):
    """Tokens of several characters each (a stop string can sit inside one token's text)."""

    VOCAB = ["Hello", " wor", "ld", "!", " STOP", "ST", "OP", " x", "é", "ab", "<e>"]

    def __init__(self) -> None:
        self.vocab_size, self.bos_token_id, self.eos_token_ids = len(self.VOCAB), None, [10]
        self.chat_template = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join("" if (i == 10 and skip_special_tokens) else self.VOCAB[i] for i in ids)


def _ids(*words: str) -> list[int]:
    return [WordTokenizer.VOCAB.index(w) for w in words]


def _run(text: ChoiceText, pushes, finish: str | None = "length", logprobs=False):
    """Push each list of `pushes` (the last with `finish`); returns (shown text, tokens taken)."""
    shown, taken = "", []
    for n, ids in enumerate(pushes):
        lps = [(-float(i), [(i, -float(i))]) for i in ids] if logprobs else None
        shown += text.push(ids, finish if n == len(pushes) - 1 else None, lps)
        taken += text.take_tokens()
        if text.done:
            break
    return shown, taken


def test_a_stop_string_across_token_boundaries_ends_the_text_before_it():
    t = ChoiceText(WordTokenizer(), stops=["world"])
    shown, taken = _run(t, [_ids("Hello", " wor"), _ids("ld", "!", " x")], finish=None)
    assert shown == "Hello " and t.stopped and t.done
    assert t.token_ids == _ids("Hello", " wor", "ld")  # through the token that completed it
    assert [tok.id for tok in taken] == t.token_ids and t.tokens == 3


def test_a_stop_string_inside_one_token_and_include_stop_str_in_output():
    t = ChoiceText(WordTokenizer(), stops=["TO"])
    assert _run(t, [_ids("Hello", " STOP", " x")], finish=None)[0] == "Hello S"
    assert t.token_ids == _ids("Hello", " STOP")
    t = ChoiceText(WordTokenizer(), stops=["STOP"], include_stop=True)
    shown, taken = _run(t, [_ids("Hello", "ST"), _ids("OP", " x")], finish=None, logprobs=True)
    assert shown == "HelloSTOP" and t.stopped
    assert [(tok.id, tok.logprob, tok.top) for tok in taken] == [
        (i, -float(i), ((i, -float(i)),)) for i in _ids("Hello", "ST", "OP")]


def test_the_earliest_stop_string_wins_and_a_later_push_changes_nothing():
    t = ChoiceText(WordTokenizer(), stops=["!", "wor"])
    assert _run(t, [_ids("Hello", " wor", "ld", "!")], finish=None)[0] == "Hello "
    assert t.push(_ids(" x"), "length") == "" and t.token_ids == _ids("Hello", " wor")


def test_a_stream_holds_back_only_a_possible_stop_prefix():
    t = ChoiceText(WordTokenizer(), stops=[" STOPPED"])
    assert t.push(_ids("Hello", " STOP")) == "Hello"      # " STOP" may become the stop string
    assert t.take_tokens() == [t.entries[0]]               # only the shown token
    assert t.push(_ids("!")) == " STOP!"                    # it did not
    assert [tok.id for tok in t.take_tokens()] == _ids(" STOP", "!")
    assert t.push([], "length") == "" and t.done and not t.stopped


def test_a_stop_token_id_is_counted_but_no_text_nor_entry():
    t = ChoiceText(WordTokenizer(), stop_ids=[10])
    shown, taken = _run(t, [_ids("Hello", "<e>")], finish="stop", logprobs=True)
    assert shown == "Hello" and t.token_ids == _ids("Hello", "<e>") and t.tokens == 2
    assert [tok.id for tok in taken] == _ids("Hello")


def test_multi_byte_characters_split_over_tokens():
    tok = ByteLevelTokenizer()
    t = ChoiceText(tok, stops=["é!"])
    ids = list("aé!b".encode())
    assert t.push(ids[:2]) == "a"  # half of é waits
    assert t.push(ids[2:]) == "" and t.stopped and t.text == "a"
    assert t.token_ids == ids[:4]  # a, é (two bytes), !


def test_bad_stop_strings_are_named():
    with pytest.raises(ValueError, match="stop: expected non-empty strings"):
        ChoiceText(WordTokenizer(), stops=[""])


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet="ab#\né", max_size=24), cuts=st.lists(st.integers(0, 40), max_size=6),
       stops=st.lists(st.text(alphabet="ab#\né", min_size=1, max_size=3), max_size=2),
       include=st.booleans())
def test_any_split_into_pushes_returns_the_whole_text_cut_once(text, cuts, stops, include):
    """Byte ids split anywhere (inside characters, stop strings, windows): the shown text is
    the text up to the first stop string (plus it when included), whatever the split."""
    tok = ByteLevelTokenizer()
    ids = list(text.encode())
    bounds = sorted({min(c, len(ids)) for c in cuts} | {0, len(ids)})
    pushes = [ids[a:b] for a, b in zip(bounds, bounds[1:], strict=False)] or [[]]
    t = ChoiceText(tok, stops=stops, include_stop=include)
    shown, taken = _run(t, pushes, finish="length")
    hits = [(text.find(s), len(s)) for s in stops if s in text]
    if hits:
        i, n = min(hits)
        want = text[: i + n] if include else text[:i]
    else:
        want = text
    assert shown == want and t.stopped == bool(hits)
    kept = tok.decode(t.token_ids)
    assert kept.startswith(want) and len(t.token_ids) <= len(ids)
    if hits:  # the last kept token completed the stop string: one fewer would not hold it
        i, n = min(hits)
        assert text[: i + n] in kept and text[: i + n] not in tok.decode(t.token_ids[:-1])
    assert [x.id for x in taken] == t.token_ids


# --- the CLI -----------------------------------------------------------------------------
def test_cli_json_cuts_tokens_and_logprobs_at_the_stop_string(capsys):
    from graphdraft.serving.cli import main
    base = ["generate", "--device", "cpu", "--quiet", "--prompt", "def main():\n",
            "--max-new-tokens", "16", "--logprobs", "2"]
    assert main([*base, "--json"]) == 0
    full = json.loads(capsys.readouterr().out)["outputs"][0]
    assert len(full["logprobs"]) == len(full["token_ids"]) - (full["finish_reason"] == "stop")
    stop = full["text"][4:7]
    assert stop and stop in full["text"]
    assert main([*base, "--json", "--stop", stop]) == 0
    cut = json.loads(capsys.readouterr().out)["outputs"][0]
    assert cut["text"] == full["text"][: full["text"].index(stop)]
    assert cut["finish_reason"] == "stop"
    ids = cut["token_ids"]
    assert ids == full["token_ids"][: len(ids)] and len(ids) < len(full["token_ids"])
    assert cut["logprobs"] == full["logprobs"][: len(ids)]
    assert all(len(e["top_logprobs"]) == 2 for e in cut["logprobs"])
    assert main([*base, "--json-lines", "--stop", stop, "--include-stop-str-in-output"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    text = "".join(x.get("text", "") for x in lines)
    assert text == full["text"][: full["text"].index(stop) + len(stop)]
    streamed = [e for x in lines for e in x.get("logprobs", [])]
    assert streamed == full["logprobs"][: len(ids)]
    assert lines[-1] == {"index": 0, "finish_reason": "stop", "completion_tokens": len(ids)}
