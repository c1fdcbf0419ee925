"""Think blocks to reasoning_content, streamed in pieces of any size."""
import pytest

from handler.reasoning import ReasoningSplitter, starts_in_reasoning, uses_think_tags


def split(text, step, inside=False):
    splitter = ReasoningSplitter(inside)
    reasoning, content = "", ""
    for start in range(0, len(text), step):
        r, c = splitter.feed(text[start:start + step])
        reasoning, content = reasoning + r, content + c
    r, c = splitter.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize("step", [1, 3, 1000])
@pytest.mark.parametrize("text, inside, expected", [
    ("<think>\nThe user greets.\n</think>\n\nHello!", False, ("The user greets.", "Hello!")),
    ("\n<think>a < b</think>Yes", False, ("a < b", "Yes")),
    ("Plain answer with <think> inside", False, ("", "Plain answer with <think> inside")),
    ("  Plain answer", False, ("", "  Plain answer")),
    ("already thinking\n</think>\n\nDone", True, ("already thinking", "Done")),
    ("<think>cut off by the length lim", False, ("cut off by the length lim", "")),
    ("<thi", False, ("", "<thi")),
])
def test_reasoning_and_content_apart(text, inside, expected, step):
    assert split(text, step, inside) == expected


def test_qwen3_style_templates_and_prompts():
    template = "{%- if enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}"
    assert uses_think_tags(template) and not uses_think_tags("{{ messages }}") and not uses_think_tags(None)
    assert starts_in_reasoning("<|im_start|>assistant\n<think>\n")
    assert not starts_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not starts_in_reasoning("<|im_start|>assistant\n")
