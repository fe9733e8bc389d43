"""The math and format reward functions on real GSM8K and MATH answer formats."""

from __future__ import annotations

import sys

import pytest

from trl_costaware.rewards import (
    boxed_format_reward,
    extract_boxed,
    extract_gsm8k_answer,
    gsm8k_accuracy_reward,
    math_accuracy_reward,
    parse_number,
    think_answer_format_reward,
)

# GSM8K references (openai/gsm8k, config "main", column "answer"): worked solution, calculator annotations, "#### n".
NATALIA = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"
)
WENG = (
    "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\n"
    "Working 50 minutes, she earned 0.2 x 50 = $<<0.2*50=10>>10.\n#### 10"
)
BIG = "The house costs 80000+50000 = $<<80000+50000=130000>>130,000 in total.\n#### 130000"
NEGATIVE = "The temperature dropped 5 - 12 = <<5-12=-7>>-7 degrees.\n#### -7"
DECIMAL = "Each costs 7/2 = $<<7/2=3.5>>3.5.\n#### 3.5"


def chat(text):
    return [{"role": "assistant", "content": text}]


@pytest.mark.parametrize(
    "completion, reference, expected",
    [
        ("In May she sold 24, so 48 + 24 = 72 clips.\n#### 72", NATALIA, 1.0),
        ("She sold 72 clips altogether.", NATALIA, 1.0),  # last number
        ("The answer is $\\boxed{72}$.", NATALIA, 1.0),
        ("<think>48 + 24</think><answer>72</answer>", NATALIA, 1.0),
        ("#### 72.", NATALIA, 1.0),
        ("48 + 24 = 72 clips, then 72 / 2 = 36.", NATALIA, 0.0),  # the last number is the answer
        ("#### 36", NATALIA, 0.0),
        ("I don't know.", NATALIA, 0.0),
        ("She earned $10.00 yesterday.", WENG, 1.0),
        ("She earned \\boxed{\\$10}", WENG, 1.0),
        ("0.2 x 50 = $10.", WENG, 1.0),
        ("She earned $10.50.", WENG, 0.0),
        ("The total is $130,000.", BIG, 1.0),
        ("#### 130,000", BIG, 1.0),
        ("\\boxed{130{,}000}", BIG, 0.0),  # LaTeX {,} grouping is not a GSM8K answer style
        ("#### 13,000", BIG, 0.0),
        ("It dropped to -7 degrees.", NEGATIVE, 1.0),
        ("5-12=-7", NEGATIVE, 1.0),
        ("It dropped 7 degrees.", NEGATIVE, 0.0),
        ("Each costs $3.50.", DECIMAL, 1.0),
        ("\\boxed{\\frac{7}{2}}", DECIMAL, 1.0),
        ("Each costs 35 cents", DECIMAL, 0.0),
        (chat("So the answer is 72."), NATALIA, 1.0),  # conversational completion
        ("72", "72", 1.0),  # a bare numeric reference
    ],
)
def test_gsm8k_accuracy(completion, reference, expected):
    assert gsm8k_accuracy_reward([completion], answer=[reference]) == [expected]


def test_gsm8k_reference_without_a_number_is_skipped():
    assert gsm8k_accuracy_reward(["#### 3", "#### 3"], answer=["\\frac{\\pi}{2}", ""]) == [None, None]


@pytest.mark.parametrize(
    "text, number",
    [
        ("#### 1,234", "1234"),
        ("costs $1,200.50.", "1200.50"),
        ("20 - 2 = 18", "18"),
        ("x=-4", "-4"),
        ("<answer>72 dollars</answer>", "72"),
        ("The answer is 18.", "18"),
        ("pages 3-4", "4"),
        ("no digits", None),
    ],
)
def test_extract_gsm8k_answer(text, number):
    assert extract_gsm8k_answer(text) == number


@pytest.mark.parametrize(
    "text, value",
    [("1,234", 1234), ("$3.50", 3.5), ("-0.5", -0.5), (".5", 0.5), ("50\\%", 50), ("3/4", 0.75)]
    + [("\\frac{3}{4}", 0.75), ("-\\frac{3}{4}", -0.75), ("18.", 18), ("12 dollars", 12), ("10,\\!000", 10000)]
    + [("2\\sqrt{3}", None), ("\\pi", None), ("1,2", None)],
)
def test_parse_number(text, value):
    parsed = parse_number(text)
    assert (parsed is None) if value is None else (parsed == pytest.approx(value))


# MATH solutions (hendrycks/competition_math, column "solution"): worked solutions ending in \boxed{...}.
MATH_FRAC = r"Adding, we get $\frac{8}{3} + 2 = \boxed{\frac{14}{3}}$."
MATH_POLAR = (
    r"We have that $r = \sqrt{0^2 + 3^2} = 3.$ Also, if we draw the line connecting the origin and $(0,3),$ this line "
    r"makes an angle of $\frac{\pi}{2}$ with the positive $x$-axis. Therefore, the polar coordinates are "
    r"$\boxed{\left( 3, \frac{\pi}{2} \right)}.$"
)
MATH_CHOICE = r"Only the graph in (C) passes the vertical line test, so the answer is $\boxed{\text{(C)}}.$"
MATH_THOUSANDS = r"There are $8!/4 = \boxed{10,\!080}$ arrangements."
MATH_DEGREES = r"So $\angle ABC = \boxed{90^\circ}$."
MATH_MONEY = r"She pays $\boxed{\$18.90}$ in total."
MATH_UNITS = r"The side has length $\boxed{4 \text{ inches}}$."
MATH_INTERVAL = r"Hence the domain is $\boxed{[-2,7]}$."
MATH_SQRT = r"So the distance is $\boxed{3\sqrt{2}}$."
MATH_NESTED = r"Thus $\cos \theta = \boxed{\frac{\sqrt{3}}{2}}.$"
MATH_EQUATION = r"The line is $\boxed{y = 2x + 3}$."
MATH_SET = r"The solutions are $\boxed{\{1, 2\}}$."


@pytest.mark.parametrize(
    "completion, reference, expected",
    [
        (r"The answer is $\boxed{\frac{14}{3}}$.", MATH_FRAC, 1.0),
        (r"$\boxed{\dfrac{14}{3}}$", MATH_FRAC, 1.0),
        (r"\boxed{\tfrac{14}{3}}", MATH_FRAC, 1.0),
        (r"\boxed{14/3}", MATH_FRAC, 1.0),
        (r"\boxed{\frac{28}{6}}", MATH_FRAC, 1.0),  # equal rationals
        (r"\boxed{4.67}", MATH_FRAC, 0.0),  # a rounded decimal is not the exact answer
        (r"\boxed{\frac{13}{3}}", MATH_FRAC, 0.0),
        ("The final answer is $14/3$.", MATH_FRAC, 1.0),  # "final answer is" + LaTeX
        ("So the answer is 72.", NATALIA, 1.0),
        ("I think 72 but not sure", NATALIA, 0.0),  # unmarked
        ("14/3", MATH_FRAC, 0.0),  # unmarked: no credit
        (r"\boxed{(3,\frac{\pi}{2})}", MATH_POLAR, 1.0),
        (r"\boxed{\left(3, \dfrac{\pi}{2}\right)}", MATH_POLAR, 1.0),
        (r"\boxed{(3, \pi)}", MATH_POLAR, 0.0),
        (r"\boxed{\text{(C)}}", MATH_CHOICE, 1.0),
        (r"\boxed{(C)}", MATH_CHOICE, 1.0),
        (r"\boxed{(B)}", MATH_CHOICE, 0.0),
        (r"\boxed{10080}", MATH_THOUSANDS, 1.0),
        (r"\boxed{10,080}", MATH_THOUSANDS, 1.0),
        (r"\boxed{1008}", MATH_THOUSANDS, 0.0),
        (r"\boxed{90}", MATH_DEGREES, 1.0),
        (r"\boxed{90^{\circ}}", MATH_DEGREES, 1.0),
        (r"\boxed{18.90}", MATH_MONEY, 1.0),
        (r"\boxed{\$18.9}", MATH_MONEY, 1.0),
        (r"\boxed{4}", MATH_UNITS, 1.0),
        (r"\boxed{4\text{ in.}}", MATH_UNITS, 1.0),
        (r"\boxed{[-2, 7]}", MATH_INTERVAL, 1.0),
        (r"\boxed{(-2,7)}", MATH_INTERVAL, 0.0),  # open vs closed interval
        (r"\boxed{3 \sqrt{2}}", MATH_SQRT, 1.0),
        (r"\boxed{\sqrt{18}}", MATH_SQRT, 1.0),  # symbolic equality
        (r"\boxed{3\sqrt2}", MATH_SQRT, 1.0),  # malformed operators (TRL's accuracy_reward gives 0)
        (r"\boxed{2\sqrt{3}}", MATH_SQRT, 0.0),
        (r"\boxed{\dfrac{\sqrt{3}}{2}}", MATH_NESTED, 1.0),
        (r"\boxed{\frac{\sqrt{2}}{2}}", MATH_NESTED, 0.0),
        (r"\boxed{y=2x+3}", MATH_EQUATION, 1.0),
        (r"\boxed{\{1,2\}}", MATH_SET, 1.0),
        (r"<think>solve</think><answer>\frac{14}{3}</answer>", MATH_FRAC, 1.0),
        (r"<answer>\boxed{14/3}</answer>", MATH_FRAC, 1.0),
        (r"first \boxed{3}, finally \boxed{\frac{14}{3}}", MATH_FRAC, 0.0),  # several boxes: the set {3, 14/3}
        (chat(r"$\boxed{\frac{14}{3}}$"), MATH_FRAC, 1.0),
        (r"#### 72", NATALIA, 1.0),  # GSM8K references work too
        (r"\boxed{72}", NATALIA, 1.0),
        (r"<answer>72</answer>", NATALIA, 1.0),
        (r"#### 1,234", "#### 1234", 1.0),
        (r"\boxed{50\%}", r"$\boxed{\frac{1}{2}}$", 1.0),  # percent
        (r"\boxed{0.50}", r"The probability is $\boxed{\frac12}$.", 1.0),  # decimals, \frac12
        (r"\boxed{0.33}", r"$\boxed{\frac{1}{3}}$", 0.0),
    ],
)
def test_math_accuracy(completion, reference, expected):
    assert math_accuracy_reward([completion], solution=[reference]) == [expected]


def test_math_accuracy_reads_answer_then_solution_columns():
    # MATH-500 / DeepMath-style: a bare final answer in `answer` (preferred) or `solution`.
    assert math_accuracy_reward([r"\boxed{\frac{1}{3}}"], answer=[r"\frac13"], solution=["unused"]) == [1.0]
    assert math_accuracy_reward([r"\boxed{\frac{1}{3}}"], solution=[r"\dfrac{1}{3}"]) == [1.0]
    assert math_accuracy_reward([r"\boxed{1}"], answer=[""]) == [None]
    with pytest.raises(ValueError, match="answer"):
        math_accuracy_reward([r"\boxed{1}"])


def test_rewards_log_the_parsed_answers():
    logged = {}
    math_accuracy_reward(["\\boxed{2}", "no answer"], answer=["2", "3"], log_extra=logged.__setitem__)
    gsm8k_accuracy_reward(["#### 2"], answer=["#### 2"], log_extra=logged.__setitem__)
    assert logged["gsm8k_parsed"] == ["2"]
    assert logged["answer_parsed"] == ["2", "[none]"] and logged["gold_parsed"] == ["2", "3"]


@pytest.mark.parametrize(
    "text, content",
    [
        (r"so \boxed{\frac{\sqrt{3}}{2}} and", r"\frac{\sqrt{3}}{2}"),
        (r"\boxed{a} then \boxed{b}", "b"),
        (r"\boxed 5.", "5"),
        (r"\fbox{7}", "7"),
        (r"\boxed{5", None),
        ("nothing", None),
    ],
)
def test_extract_boxed(text, content):
    assert extract_boxed(text) == content


@pytest.mark.parametrize(
    "prediction, reference, expected",
    [(r"\frac12", "0.5", 1.0), ("x = 5", "5", 1.0), (r"\frac{1}{3}", "0.33", 0.0), ("[1,2]", "(1,2)", 0.0)]
    + [(r"\infty", r"\infty", 1.0), ("12", "1,2", 0.0), (r"\frac{-3}{4}", r"-\frac{3}{4}", 1.0)]
    + [("(1.0, 2)", "(1,2)", 1.0), (r"\frac{1}{2}\text{ square units}", r"\frac12", 1.0), (r"\text{(C)}", "C", 1.0)],
)
def test_math_accuracy_bare_references(prediction, reference, expected):
    """DeepMath / MATH-500 style: the reference column holds only the final LaTeX answer."""
    assert math_accuracy_reward([rf"\boxed{{{prediction}}}"], answer=[reference]) == [expected]


@pytest.mark.xfail(strict=True, reason="math-verify 0.9 reads '14/3.' as 14/3.0, a float unequal to 14/3")
def test_math_accuracy_plain_fraction_before_a_period():
    assert math_accuracy_reward(["The answer is 14/3."], solution=[MATH_FRAC]) == [1.0]


def test_math_accuracy_names_the_extra_when_math_verify_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # `import math_verify` now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'trl-costaware\[math\]'"):
        math_accuracy_reward([r"\boxed{1}"], answer=["1"])


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("<think>\n48 + 24 = 72\n</think>\n<answer>72</answer>", 1.0),
        ("<think>x</think><answer>72</answer>\n", 1.0),
        ("<think>x</think>72", 0.0),
        ("<answer>72</answer>", 0.0),
        ("<think>x</think><answer></answer>", 0.0),
        ("<think>a</think><think>b</think><answer>1</answer>", 0.0),
        ("<think>x</think><answer>1</answer> trailing text", 0.0),
        (chat("<think>x</think><answer>1</answer>"), 1.0),
    ],
)
def test_think_answer_format(completion, expected):
    assert think_answer_format_reward([completion]) == [expected]


def test_boxed_format():
    assert boxed_format_reward([r"so \boxed{3}", r"\boxed{}", r"\boxed{3", "3", chat(r"\boxed{x}")]) == [
        1.0,
        0.0,
        0.0,
        0.0,
        1.0,
    ]
