"""The Kimi output parser on real token streams: text generated as the engine's `Sequence` releases it,
fed whole, token by token, and split in two at every position; the result never depends on the split."""

from __future__ import annotations

import pytest

from k3stream.engine.generate import Sequence
from k3stream.engine.sampling import SamplingParams
from k3stream.engine.tokenizer import Tokenizer, VocabFields
from k3stream.gguf.vocab import padded
from k3stream.server.kimi_output import THINK_PAIRS, TOOL_TOKENS, KimiFormat, OutputParser, Piece, ToolCall
from k3stream.testing.tinyvocab import tiny_vocab

TOOLS = ("get_weather", "get_time")
SECTION = (
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
    '{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>functions.get_time:1'
    '<|tool_call_argument_begin|>{"tz":"UTC"}<|tool_call_end|><|tool_calls_section_end|>'
)
CALLS = [
    ToolCall(0, "functions.get_weather:0", "get_weather", '{"city": "Paris"}'),
    ToolCall(1, "functions.get_time:1", "get_time", '{"tz":"UTC"}'),
]


def make_tokenizer(specials: tuple[str, ...] = ()) -> Tokenizer:
    """The tiny vocabulary with its first padding ids turned into `specials` (CONTROL)."""
    vocab = padded(tiny_vocab(), len(tiny_vocab().tokens) + 4)
    tokens, types = list(vocab.tokens), list(vocab.token_types)
    for offset, text in enumerate(specials):
        tokens[len(tiny_vocab().tokens) + offset] = text
        types[len(tiny_vocab().tokens) + offset] = 3
    merges = list(vocab.merges)
    fields = VocabFields(tokens, types, "gpt2", "kimi-k2", vocab.bos_id, vocab.eos_id, merges=merges)
    return Tokenizer(fields)


@pytest.fixture(scope="module")
def think_tokenizer() -> Tokenizer:
    return make_tokenizer(("<think>", "</think>"))


def released(tokenizer: Tokenizer, fmt: KimiFormat, output: str) -> list[str]:
    """The text the engine's Sequence releases for each token of `output`."""
    ids = tokenizer.encode(output, allow_special=True)
    sequence = Sequence(tokenizer, [0], SamplingParams(max_tokens=len(ids) + 1), marks=fmt.marks)
    return [sequence.accept(token) for token in ids]


def parse(fmt: KimiFormat, feeds: list[str], **options) -> Piece:
    parser = OutputParser(fmt, TOOLS, **options)
    total = Piece()
    for text in feeds:
        total.extend(parser.feed(text))
    total.extend(parser.finish())
    return total


def every_split(fmt: KimiFormat, pieces: list[str], **options) -> Piece:
    """The parse of `pieces`, asserted equal whole, one piece at a time and split at every position."""
    whole = parse(fmt, ["".join(pieces)], **options)
    assert parse(fmt, pieces, **options) == whole
    for cut in range(len(pieces) + 1):
        assert parse(fmt, ["".join(pieces[:cut]), "".join(pieces[cut:])], **options) == whole
    return whole


def test_reasoning_content_and_two_calls(think_tokenizer):
    fmt = KimiFormat.for_tokenizer(think_tokenizer)
    output = f"<think>Plan: ask twice.</think>Sure, checking.{SECTION}"
    result = every_split(fmt, released(think_tokenizer, fmt, output))
    assert result.reasoning == "Plan: ask twice."
    assert result.content == "Sure, checking."
    assert result.tool_calls == CALLS


def test_reasoning_opened_by_the_prompt(think_tokenizer):
    fmt = KimiFormat.for_tokenizer(think_tokenizer)
    pieces = released(think_tokenizer, fmt, "still thinking</think>Answer.")
    result = every_split(fmt, pieces, in_reasoning=True)
    assert (result.reasoning, result.content) == ("still thinking", "Answer.")


def test_reasoning_split_can_be_turned_off(think_tokenizer):
    fmt = KimiFormat.for_tokenizer(think_tokenizer)
    output = "<think>hidden</think>Answer."
    result = every_split(fmt, released(think_tokenizer, fmt, output), reasoning=False)
    assert (result.reasoning, result.content) == ("", output)


@pytest.mark.parametrize(
    "call",
    [
        'functions.rm_rf:0<|tool_call_argument_begin|>{"path": "/"}',  # unknown function
        "functions.get_weather:0<|tool_call_argument_begin|>[1, 2]",  # arguments not an object
        'functions.get_weather:0{"city": "Paris"}',  # no argument delimiter
    ],
)
def test_malformed_call_comes_back_as_text(think_tokenizer, call):
    fmt = KimiFormat.for_tokenizer(think_tokenizer)
    section = (
        f"<|tool_calls_section_begin|><|tool_call_begin|>{call}<|tool_call_end|><|tool_calls_section_end|>"
    )
    result = every_split(fmt, released(think_tokenizer, fmt, "Hi." + section))
    assert result.tool_calls == [] and result.content == "Hi." + section


def test_a_call_cut_off_before_its_arguments_is_the_call_without_them(think_tokenizer):
    fmt = KimiFormat.for_tokenizer(think_tokenizer)
    for end in ("<|tool_call_argument_begin|>", "{"):
        output = SECTION[: SECTION.index(end)]
        result = every_split(fmt, released(think_tokenizer, fmt, output))
        assert result.tool_calls == [ToolCall(0, "functions.get_weather:0", "get_weather", "")]
        assert result.content == ""


def test_no_cut_of_an_answer_with_calls_spills_markup_into_its_text(think_tokenizer):
    """An answer with reasoning, text and two calls, cut after each of its tokens (as `max_tokens` cuts
    it): its text and reasoning never hold delimiter text, and each call that came is the whole answer's,
    its arguments as far as they came; a call whose header names its tool whole is there, without
    arguments if none came."""
    fmt = KimiFormat.for_tokenizer(think_tokenizer)
    output = f"<think>Plan: ask twice.</think>Sure, checking.{SECTION}"
    pieces = released(think_tokenizer, fmt, output)
    markup = (*TOOL_TOKENS, "<think>", "</think>")
    named = 0
    for cut in range(len(pieces) + 1):
        result = every_split(fmt, pieces[:cut])
        text = "".join(pieces[:cut])
        spilled = [token for token in markup if token in result.content + result.reasoning]
        assert not spilled, (text, result)
        assert "Sure, checking.".startswith(result.content) and "Plan: ask twice.".startswith(
            result.reasoning
        )
        for call, whole in zip(result.tool_calls, CALLS, strict=False):
            assert (call.id, call.name) == (whole.id, whole.name)
            assert whole.arguments.startswith(call.arguments)
        assert len(result.tool_calls) >= fmt.spell(text).count("<|tool_call_argument_begin|>")
        named += any(call.arguments == "" for call in result.tool_calls)
    assert named > 1, "no cut fell between a call's name and its arguments"


@pytest.mark.parametrize(
    ("after", "arguments"),
    [
        ('{"city": "Par<|tool_call_end|><|tool_calls_section_end|>', '{"city": "Par'),  # bad JSON
        ('{"city": "Par', '{"city": "Par'),  # cut off (max_tokens)
        ('  {"city": "Paris"}  <|tool_calls_section_end|>', '{"city": "Paris"}'),  # no call end
    ],
)
def test_an_opened_call_keeps_its_arguments_as_they_came(think_tokenizer, after, arguments):
    """Once its header names a tool and its arguments begin with `{`, a call is streamed: what follows
    is its arguments (stripped), JSON or not, as OpenAI's arguments may not be JSON."""
    fmt = KimiFormat.for_tokenizer(think_tokenizer)
    output = (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
    )
    result = every_split(fmt, released(think_tokenizer, fmt, output + after))
    assert result.tool_calls == [ToolCall(0, "functions.get_weather:0", "get_weather", arguments)]
    assert result.content == ""


def test_a_freeform_tools_arguments_are_its_text_as_written(think_tokenizer):
    """A freeform tool's call (the Responses API's custom tools) opens whatever its text begins with, and
    its arguments are the text between the delimiters, whitespace and all; a function's call in the same
    section is parsed as ever. Without `freeform` the same call is not one: its text is no JSON object."""
    fmt = KimiFormat.for_tokenizer(think_tokenizer)
    patch = " *** Begin Patch\n*** Add File: a.txt\n+hi there\n*** End Patch\n"
    output = (
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_time:0<|tool_call_argument_begin|>"
        f"{patch}<|tool_call_end|><|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>"
        '{"city": "Paris"} <|tool_call_end|><|tool_calls_section_end|>'
    )
    pieces = released(think_tokenizer, fmt, output)
    result = every_split(fmt, pieces, freeform=("get_time",))
    assert result.tool_calls == [
        ToolCall(0, "functions.get_time:0", "get_time", patch),
        ToolCall(1, "functions.get_weather:1", "get_weather", '{"city": "Paris"}'),
    ]
    assert result.content == ""
    assert parse(fmt, pieces).tool_calls == []


def test_call_arguments_stream_in_pieces_that_join_to_the_whole(think_tokenizer):
    """Fed token by token, a call comes as OpenAI streams it: its id and name (with the argument text
    its token released), then the argument text in several pieces with the index alone; joined they
    are the whole answer's call."""
    fmt = KimiFormat.for_tokenizer(think_tokenizer)
    long_call = SECTION.replace('"Paris"', '"Paris, the capital of France, on the Seine"')
    pieces = released(think_tokenizer, fmt, long_call)
    parser = OutputParser(fmt, TOOLS)
    calls = [call for text in pieces for call in parser.feed(text).tool_calls]
    calls += parser.finish().tool_calls
    first = [call.openai() for call in calls if call.index == 0]
    assert {key: first[0][key] for key in ("index", "id", "type")} == {
        "index": 0,
        "id": "functions.get_weather:0",
        "type": "function",
    }
    assert first[0]["function"]["name"] == "get_weather"
    assert len(first) > 5 and all(set(delta) == {"index", "function"} for delta in first[1:])
    whole = parse(fmt, ["".join(pieces)]).tool_calls
    assert "".join(delta["function"]["arguments"] for delta in first) == whole[0].arguments
    assert whole[0].arguments == '{"city": "Paris, the capital of France, on the Seine"}'
    joined = Piece()
    for call in calls:
        joined.add_call(call)
    assert joined.tool_calls == whole


def test_each_ended_call_is_heard_with_its_arguments_as_the_model_wrote_them(think_tokenizer):
    """`on_call` hears each call once it ends, its arguments with the whitespace around them that the
    answer's call leaves out (the prompt cache holds what the model wrote), whatever the split; a call
    cut off is not heard."""
    fmt = KimiFormat.for_tokenizer(think_tokenizer)
    spaced = SECTION.replace('{"city": "Paris"}', ' {"city": "Paris"}\n')
    cut = (
        '<|tool_calls_section_begin|><|tool_call_begin|>functions.get_time:2<|tool_call_argument_begin|>{"tz'
    )
    pieces = released(think_tokenizer, fmt, spaced + cut)
    for split in range(len(pieces) + 1):
        heard: list[tuple[str, str]] = []
        halves = ["".join(pieces[:split]), "".join(pieces[split:])]
        result = parse(fmt, halves, on_call=lambda *call, heard=heard: heard.append(call))
        assert result.tool_calls[:2] == CALLS
        assert heard == [(CALLS[0].id, ' {"city": "Paris"}\n'), (CALLS[1].id, CALLS[1].arguments)]


def test_valid_call_kept_when_a_later_one_is_cut_off(think_tokenizer):
    fmt = KimiFormat.for_tokenizer(think_tokenizer)
    first = SECTION[: SECTION.index("<|tool_call_begin|>functions.get_time")]
    output = first + "<|tool_call_begin|>functions.get_ti"
    result = every_split(fmt, released(think_tokenizer, fmt, output))
    assert result.tool_calls == CALLS[:1]
    assert result.content == ""  # a header cut before its tool's name is whole names no call


# answers and the indexes of their unfinished calls: cut inside (or right after) the arguments, before
# them, or ended with arguments that are no JSON object
UNFINISHED_CALLS = {
    "both calls ended": (SECTION, set()),
    "cut inside the second's arguments": (SECTION[: SECTION.index('"UTC"')], {1}),
    "cut after a whole object, before the call's end": (
        SECTION[: SECTION.index("}<|tool_call_end|>") + 1],
        {0},
    ),
    "cut between the header and the arguments": (
        SECTION[: SECTION.index("<|tool_call_argument_begin|>")],
        {0},
    ),
    "arguments that end but are no object": (SECTION.replace('"Paris"}', '"Paris"]'), {0}),
}


@pytest.mark.parametrize("output, unfinished", UNFINISHED_CALLS.values(), ids=UNFINISHED_CALLS.keys())
def test_a_call_is_unfinished_where_the_answer_ends_inside_it_or_its_arguments_are_no_object(
    think_tokenizer, output, unfinished
):
    """`unfinished` names the calls not to run, however the text was split; `calls_complete` holds only
    where the answer made calls and none is unfinished."""
    fmt = KimiFormat.for_tokenizer(think_tokenizer)
    pieces = released(think_tokenizer, fmt, output)
    for feeds in (["".join(pieces)], pieces):
        parser = OutputParser(fmt, TOOLS)
        for text in feeds:
            parser.feed(text)
        parser.finish()
        assert parser.unfinished == unfinished
        assert parser.calls_complete == (not unfinished)


def test_no_cut_inside_a_think_delimiter_of_several_tokens_spills_it_into_the_text():
    """Kimi-K3's think channel (`<|open|>think<|sep|>` ... `<|close|>think<|sep|><|open|>response<|sep|>`,
    several tokens each): an answer cut after any token never holds a piece of either delimiter in its
    reasoning or text."""
    tokenizer = make_tokenizer(("<|open|>", "<|close|>", "<|sep|>"))
    opening, closing = THINK_PAIRS[2]
    fmt = KimiFormat.for_tokenizer(tokenizer, template_text=f"{{{{ '{opening}' }}}}...{{{{ '{closing}' }}}}")
    assert fmt.spell(fmt.think[0]) == opening
    pieces = released(tokenizer, fmt, f"{opening}Plan.{closing}Sure.{SECTION}")
    assert len(tokenizer.encode(closing, allow_special=True, add_bos=False)) > 3
    for cut in range(len(pieces) + 1):
        result = every_split(fmt, pieces[:cut])
        text = result.reasoning + result.content
        assert not any(token in text for token in ("<|open|>", "<|close|>", "<|sep|>", *TOOL_TOKENS)), text
        assert "Plan.".startswith(result.reasoning) and "Sure.".startswith(result.content)


def test_delimiter_spelled_as_plain_text_is_not_one(think_tokenizer):
    fmt = KimiFormat.for_tokenizer(think_tokenizer)
    ids = think_tokenizer.encode_plain(SECTION)  # ordinary byte tokens that only spell the delimiters
    sequence = Sequence(think_tokenizer, [0], SamplingParams(max_tokens=len(ids) + 1), marks=fmt.marks)
    result = every_split(fmt, [sequence.accept(token) for token in ids])
    assert result.tool_calls == [] and result.content == SECTION


def test_every_character_written_as_text_is_content_as_written(think_tokenizer):
    """Whatever characters the model writes (the private-use ones of icon fonts included, a section
    spelled in any of them) come back as written: no text is taken for a delimiter token."""
    fmt = KimiFormat.for_tokenizer(think_tokenizer)
    written = "".join(map(chr, range(0xE000, 0xF900))) + "".join(
        chr(point) for point in range(0x20, 0x110000, 97) if not 0xD800 <= point < 0xE000
    )
    section = "".join(chr(0xE000 + offset) + chr(0xF0000 + offset) for offset in range(64)) + SECTION
    for output in (written, section):
        ids = think_tokenizer.encode_plain(output)
        sequence = Sequence(think_tokenizer, [0], SamplingParams(max_tokens=len(ids) + 1), marks=fmt.marks)
        result = parse(fmt, [sequence.accept(token) for token in ids])
        assert result.tool_calls == [] and result.content == output


@pytest.mark.parametrize(
    ("stop", "kept", "content"),
    [
        ("_call_beg", False, "Sure, "),  # inside the delimiter's text: the cut goes before it
        ("_call_beg", True, "Sure, <|tool_call_begin|>"),  # kept: the whole delimiter with it
        (", <|tool", False, "Sure"),  # from the text into the delimiter
        ("begin|>x", False, "Sure, "),
        ("<|tool_call_begin|>", True, "Sure, <|tool_call_begin|>"),
        ("x y", False, "Sure, <|tool_call_begin|>"),
    ],
)
def test_stop_strings_match_delimiter_tokens_as_their_text(think_tokenizer, stop, kept, content):
    """A delimiter token outside a section comes back as its text: a stop string matches it there as
    anywhere in the text a client reads, so no answer holds a stop string, streamed or whole."""
    fmt = KimiFormat.for_tokenizer(think_tokenizer)
    ids = think_tokenizer.encode("Sure, <|tool_call_begin|>x y z", allow_special=True)
    params = SamplingParams(max_tokens=len(ids) + 1, stop=(stop,), include_stop_str=kept)
    sequence = Sequence(think_tokenizer, [0], params, marks=fmt.marks)
    pieces = [sequence.accept(token) for token in ids if not sequence.done]
    assert sequence.finish_reason == "stop"
    assert every_split(fmt, pieces).content == content


def test_text_delimiters_from_the_template_split_at_every_character():
    """A vocabulary without think tokens whose template writes ◁think▷: matched as text, held back
    across any character split."""
    tokenizer = make_tokenizer()
    fmt = KimiFormat.for_tokenizer(tokenizer, template_text="{{ '◁think▷' }}...{{ '◁/think▷' }}")
    assert fmt.think == ("◁think▷", "◁/think▷")
    output = "◁think▷a ◁ b◁/thin◁/think▷Done ◁/think▷."
    result = every_split(fmt, list(output))
    assert (result.reasoning, result.content) == ("a ◁ b◁/thin", "Done ◁/think▷.")


def test_formats_of_the_vocabulary():
    plain = KimiFormat.for_tokenizer(make_tokenizer())
    assert plain.think is None and plain.tools is not None
    assert len(plain.marks) == 5 and all(len(mark) == 1 for mark in plain.marks.values())
    arrows = KimiFormat.for_tokenizer(make_tokenizer(("◁think▷", "◁/think▷")))
    assert arrows.think is not None and arrows.spell("".join(arrows.think)) == "◁think▷◁/think▷"


@pytest.mark.parametrize("specials", [(), ("<|open|>", "<|sep|>", "<|close|>")])
def test_the_builtin_kimi_k3_templates_think_channel(specials):
    """The built-in template's think channel (`<|open|>think<|sep|>`, closed by `<|close|>think<|sep|>`
    and the response channel's opening) is found from the template's rendering of a turn's reasoning,
    whether the XTML markers are special tokens or text; a call after it is a tool call."""
    from k3stream.engine.chat import BUILTIN_KIMI_K3_TEMPLATE

    tokenizer = make_tokenizer(specials)
    fmt = KimiFormat.for_tokenizer(tokenizer, BUILTIN_KIMI_K3_TEMPLATE)
    assert fmt.spell(fmt.think[0]) == "<|open|>think<|sep|>"
    assert fmt.spell(fmt.think[1]) == "<|close|>think<|sep|><|open|>response<|sep|>"
    output = f"Plan: ask.<|close|>think<|sep|><|open|>response<|sep|>Sure.{SECTION}"
    result = every_split(fmt, released(tokenizer, fmt, output), in_reasoning=True)
    assert (result.reasoning, result.content, result.tool_calls) == ("Plan: ask.", "Sure.", CALLS)


# the schemas of SECTION's calls: get_time's zone a list of distinct names, which llguidance cannot hold
# (it does not implement `uniqueItems`) but the finished call's check does
LISTED_ZONES = {"type": "object", "properties": {"tz": {"type": "array", "uniqueItems": True}}}
CALL_SCHEMAS = {"get_weather": {"type": "object", "required": ["city"]}, "get_time": LISTED_ZONES}
SCHEMA_CHECKS = {
    "both calls take their arguments": ('["UTC", "CET"]', set()),
    "the second's arguments break its schema": ('["UTC", "UTC"]', {1}),
}


@pytest.mark.parametrize("zones, unfinished", SCHEMA_CHECKS.values(), ids=SCHEMA_CHECKS.keys())
def test_a_call_whose_object_its_schema_does_not_take_is_unfinished(think_tokenizer, zones, unfinished):
    fmt = KimiFormat.for_tokenizer(think_tokenizer)
    output = SECTION.replace('"UTC"', zones)
    parser = OutputParser(fmt, TOOLS, schemas=CALL_SCHEMAS)
    for text in released(think_tokenizer, fmt, output):
        parser.feed(text)
    parser.finish()
    assert parser.unfinished == unfinished
