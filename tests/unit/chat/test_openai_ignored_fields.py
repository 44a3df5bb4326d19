"""The `X-Tandem-Ignored-Fields` header's text: the names a client sent, but never a control
character or an unbounded list into a header or a log line."""

from services.chat.openai_replies import MAX_IGNORED_NAMES, ignored_fields_text


def test_plain_names_are_listed_as_sent():
    assert ignored_fields_text(["frobnicate", "vendor.hint", "x-y_1"]) == "frobnicate, vendor.hint, x-y_1"
    assert ignored_fields_text([]) == ""


def test_a_name_with_control_characters_or_spaces_is_shown_as_a_question_mark():
    assert ignored_fields_text(["ok", "bad\r\nSet-Cookie: x", "é", "a" * 65]) == "ok, ?, ?, ?"


def test_a_long_list_is_cut_with_a_count_of_the_rest():
    names = [f"f{i}" for i in range(MAX_IGNORED_NAMES + 5)]
    text = ignored_fields_text(names)
    assert text.split(", ")[:MAX_IGNORED_NAMES] == names[:MAX_IGNORED_NAMES] and text.endswith("... 5 more")
