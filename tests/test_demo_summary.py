"""The demo's summary cuts a long reason at a word's end, never mid-word (issue 28, finding 6)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from poolkeeper.demo import clipped
from tests.properties import budget


def test_the_reason_that_was_cut_mid_word_ends_at_a_word() -> None:
    error = (
        "BoardServerError: board at http://127.0.0.1:40123: 500 InternalError: unexpected server error;"
        " the server logged it"
    )
    shown = clipped(f"quarantined: {error}", 100)
    assert (
        shown
        == "quarantined: BoardServerError: board at http://127.0.0.1:40123: 500 InternalError: unexpected…"
    )
    assert clipped("short enough", 100) == "short enough"


@given(st.lists(st.text(st.characters(categories=["L", "N"]), min_size=1, max_size=12), max_size=30))
@budget(200)
def test_a_clipped_text_is_whole_words_and_within_its_limit(words: list[str]) -> None:
    text = " ".join(words)
    shown = clipped(text, 40)
    assert len(shown) <= 40
    if shown != text:
        kept = shown.removesuffix("…").split(" ")
        assert kept[:-1] == words[: len(kept) - 1]
        last = kept[-1]
        # the last kept word is whole, unless one word alone is longer than half the limit
        assert last == words[len(kept) - 1] or len(kept) == 1 or len(words[len(kept) - 1]) > 20
