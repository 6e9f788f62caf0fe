"""What a streamed OpenAI reply may send before a sample ends (`rollout.server.openai_routes.StreamedText`).

The rule: the chunks must join to the final (non-streamed) text, whatever the stop strings, so
nothing is sent that the end of generation could still take back — a tail that may begin a stop
string, a stop string already complete, an unfinished UTF-8 character, the text of a stop token.
Driven here token by token with a byte tokenizer, against the final text the engine's reply has
(`engine._response`: the text up to the first stop string, or through it with `no_stop_trim`).
"""
from __future__ import annotations

import pytest

from tandem.rollout.server.openai_routes import StreamedText
from tandem.rollout.server.sampling import SamplingParams

EOS = 0


class Bytes:
    """Token t > 0 is byte t; token 0 is EOS (dropped when skipping special tokens)."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(t for t in ids if t != EOS or not skip_special_tokens).decode("utf-8", errors="replace")


def stream(text: str, stops: list[str], *, eos: bool = False, no_stop_trim: bool = False) -> tuple[str, str]:
    """(what the chunks join to, the final text) for a sample producing `text`'s bytes until the
    engine would stop it (first stop string complete, or EOS)."""
    params = SamplingParams(stop=stops, no_stop_trim=no_stop_trim)
    s = StreamedText(Bytes(), params, {EOS})
    ids = list(text.encode()) + ([EOS] if eos else [])
    sent = []
    for t in ids:
        s.ids.append(t)
        decoded = Bytes().decode(s.ids)
        hit = min((decoded.find(x) for x in stops if x in decoded), default=-1)
        if hit >= 0 or t == EOS:    # the engine finishes here
            final = decoded if hit < 0 else decoded[:hit + (len(next(x for x in stops if decoded.find(x) == hit))
                                                         if no_stop_trim else 0)]
            s.result = {"text": final}
            sent.append(s.delta())
            return "".join(sent), final
        sent.append(s.delta())
    s.result = {"text": Bytes().decode(s.ids)}
    sent.append(s.delta())
    return "".join(sent), s.result["text"]


@pytest.mark.parametrize("text, stops", [
    ("the answer is 42. done", ["done"]),
    ("aaab", ["aab"]),                       # the held tail restarts inside the stop string
    ("x = 1\n\ny = 2", ["\n\n"]),
    ("abcabd", ["abd", "cab"]),               # two stop strings, the earlier one wins
    ("no stop here", ["zz"]),
    ("héllo wörld ✓ end", ["end"]),           # multi-byte characters arrive byte by byte
])
def test_chunks_join_to_the_final_text(text, stops):
    joined, final = stream(text, stops)
    assert joined == final
    kept, final_kept = stream(text, stops, no_stop_trim=True)
    assert kept == final_kept


def test_nothing_of_a_possible_stop_string_is_sent_early():
    params = SamplingParams(stop=["END"])
    s = StreamedText(Bytes(), params, {EOS})
    s.ids += list(b"value EN")
    assert s.delta() == "value "                 # "EN" may begin "END": held
    s.ids += list(b"X")
    assert s.delta() == "ENX"                    # it did not


def test_an_unfinished_character_and_an_eos_are_held():
    s = StreamedText(Bytes(), SamplingParams(), {EOS})
    s.ids += list("a✓".encode())[:-1]            # two of the check mark's three bytes
    assert s.delta() == "a"
    s.ids.append("✓".encode()[-1])
    assert s.delta() == "✓"
    s.ids.append(EOS)
    assert s.delta() == ""
    s.result = {"text": "a✓"}
    assert s.delta() == ""


def test_new_tokens_are_handed_out_once():
    s = StreamedText(Bytes(), SamplingParams(), {EOS})
    s.ids += [97, 98]
    s.logprobs += [-0.1, -0.2]
    assert s.new_tokens() == ([97, 98], [-0.1, -0.2])
    s.ids.append(99)
    s.logprobs.append(-0.3)
    assert s.new_tokens() == ([99], [-0.3])
    assert s.new_tokens() == ([], [])
