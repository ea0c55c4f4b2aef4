"""Small typed programming problems laid out as HumanEval lays its problems out (training
prompts for a chat model's EAGLE-3 head; `graphdraft.train.chat_prompts` asks them).

HumanEval asks a model to complete a function from its header: `from typing import ...`, a
typed signature and a docstring that states the task and shows `>>>` examples. The standard
library's functions (the other code prompts) are rarely typed and rarely show examples, so
`FAMILIES` adds problems in that layout: each a reference implementation with two names, two
wordings and an argument generator; `problems(n, seed)` draws names, wordings and arguments
and writes the examples by running the reference. None of them is a HumanEval problem
(`tests/test_chat_prompts.py` checks names and wordings against HumanEval's).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """One problem: `names` (one is drawn), typed parameters `params` ((name, annotation)),
    the return annotation, `wordings` (one is drawn), the reference `solve(*args)` and
    `make(rng)` -> a tuple of arguments for an example."""

    names: tuple[str, ...]
    params: tuple[tuple[str, str], ...]
    returns: str
    wordings: tuple[str, ...]
    solve: Callable
    make: Callable[[random.Random], tuple]


def _ints(rng: random.Random, lo: int = 0, hi: int = 9, n: tuple[int, int] = (0, 6)) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(rng.randint(*n))]


def _floats(rng: random.Random, n: tuple[int, int] = (1, 5)) -> list[float]:
    return [round(rng.uniform(-5, 10), 1) for _ in range(rng.randint(*n))]


WORDS = ("apple", "river", "stone", "cloud", "tiger", "lamp", "orbit", "maple", "quiet",
         "rocket", "sand", "violet", "window", "yellow", "zebra", "delta", "ember", "fern")


def _sentence(rng: random.Random, n: tuple[int, int] = (1, 5)) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(*n)))


def _second_largest(v: list[int]) -> int | None:
    s = sorted(set(v))
    return s[-2] if len(s) > 1 else None


def _snake_to_camel(s: str) -> str:
    head, *rest = s.split("_")
    return head + "".join(w.capitalize() for w in rest)


FAMILIES: tuple[Family, ...] = (
    Family(("running_total", "cumulative_sums"), (("values", "List[int]"),), "List[int]",
           ("Return the list of running totals of values: element i is the sum of the first "
            "i + 1 values.", "Given a list of integers, return a new list where each element "
            "is the sum of all values up to and including that position."),
           lambda v: [sum(v[: i + 1]) for i in range(len(v))], lambda r: (_ints(r),)),
    Family(("chunk_list", "split_into_chunks"), (("items", "List[int]"), ("size", "int")),
           "List[List[int]]",
           ("Split items into consecutive chunks of length size; the last chunk may be shorter.",
            "Break a list into pieces of at most size elements each, keeping the order."),
           lambda v, k: [v[i: i + k] for i in range(0, len(v), k)],
           lambda r: (_ints(r, n=(0, 7)), r.randint(1, 3))),
    Family(("count_words", "word_count"), (("text", "str"),), "int",
           ("Return how many words the text has. Words are separated by spaces.",
            "Count the words in a sentence, where words are separated by whitespace."),
           lambda s: len(s.split()), lambda r: (_sentence(r, (0, 5)),)),
    Family(("capitalize_words", "title_words"), (("text", "str"),), "str",
           ("Return the text with the first letter of every word in upper case.",
            "Make each word of a sentence start with a capital letter."),
           lambda s: " ".join(w.capitalize() for w in s.split(" ")), lambda r: (_sentence(r),)),
    Family(("second_largest", "runner_up"), (("values", "List[int]"),), "Optional[int]",
           ("Return the second largest distinct value of the list, or None if there is none.",
            "Find the second biggest distinct number in a list. Return None when the list has "
            "fewer than two distinct numbers."),
           _second_largest, lambda r: (_ints(r),)),
    Family(("pairwise_differences", "consecutive_gaps"), (("values", "List[int]"),),
           "List[int]",
           ("Return the differences between consecutive values: values[i + 1] - values[i].",
            "For a list of numbers, compute how much each element changes from the previous "
            "one."),
           lambda v: [b - a for a, b in zip(v, v[1:], strict=False)],
           lambda r: (_ints(r, n=(1, 6)),)),
    Family(("clamp_values", "limit_to_range"),
           (("values", "List[float]"), ("low", "float"), ("high", "float")), "List[float]",
           ("Clamp every value into the range [low, high].",
            "Replace values below low with low and values above high with high."),
           lambda v, lo, hi: [min(max(x, lo), hi) for x in v],
           lambda r: (_floats(r), 0.0, 5.0)),
    Family(("merge_sorted", "merge_two_sorted"), (("a", "List[int]"), ("b", "List[int]")),
           "List[int]",
           ("Merge two sorted lists into one sorted list.",
            "Given two lists sorted in increasing order, return a single sorted list with all "
            "of their elements."),
           lambda a, b: sorted(a + b),
           lambda r: (sorted(_ints(r, n=(0, 4))), sorted(_ints(r, n=(0, 4))))),
    Family(("index_of_max", "argmax"), (("values", "List[float]"),), "int",
           ("Return the index of the largest value; the first one if it occurs more than once.",
            "Find the position of the maximum element in a non-empty list."),
           lambda v: v.index(max(v)), lambda r: (_floats(r),)),
    Family(("reverse_words", "words_backwards"), (("sentence", "str"),), "str",
           ("Return the sentence with its words in reverse order.",
            "Reverse the order of the words of a sentence, keeping each word as it is."),
           lambda s: " ".join(reversed(s.split())), lambda r: (_sentence(r),)),
    Family(("is_anagram", "are_anagrams"), (("first", "str"), ("second", "str")), "bool",
           ("Check whether the two words use exactly the same letters the same number of "
            "times.", "Return True if one string is a rearrangement of the letters of the "
            "other."),
           lambda a, b: sorted(a) == sorted(b),
           lambda r: (lambda w: (w, "".join(r.sample(w, len(w))) if r.random() < 0.5
                                 else r.choice(WORDS)))(r.choice(WORDS))),
    Family(("char_frequencies", "letter_counts"), (("text", "str"),), "Dict[str, int]",
           ("Return a dictionary mapping each character of the text to how often it occurs.",
            "Count how many times every character appears in a string."),
           lambda s: {c: s.count(c) for c in dict.fromkeys(s)}, lambda r: (r.choice(WORDS),)),
    Family(("dot_product", "inner_product"), (("a", "List[float]"), ("b", "List[float]")),
           "float",
           ("Return the dot product of two vectors of the same length.",
            "Multiply the two lists element by element and return the sum of the products."),
           lambda a, b: round(sum(x * y for x, y in zip(a, b, strict=True)), 2),
           lambda r: (lambda n: (_floats(r, (n, n)), _floats(r, (n, n))))(r.randint(1, 3))),
    Family(("flatten", "flatten_once"), (("nested", "List[List[int]]"),), "List[int]",
           ("Flatten a list of lists into a single list, keeping the order.",
            "Concatenate all inner lists of nested into one list."),
           lambda v: [x for inner in v for x in inner],
           lambda r: ([_ints(r, n=(0, 3)) for _ in range(r.randint(0, 3))],)),
    Family(("rotate_left", "shift_left"), (("values", "List[int]"), ("k", "int")), "List[int]",
           ("Rotate the list k positions to the left.",
            "Move the first k elements of the list to its end (k may exceed the length)."),
           lambda v, k: v[k % len(v):] + v[: k % len(v)] if v else [],
           lambda r: (_ints(r, n=(0, 5)), r.randint(0, 6))),
    Family(("longest_word", "find_longest_word"), (("sentence", "str"),), "str",
           ("Return the longest word of the sentence; the first one on a tie.",
            "Find the word with the most letters in a sentence of space-separated words."),
           lambda s: max(s.split(), key=len), lambda r: (_sentence(r),)),
    Family(("average", "mean_value"), (("values", "List[float]"),), "float",
           ("Return the arithmetic mean of a non-empty list of numbers.",
            "Compute the average of the given numbers."),
           lambda v: round(sum(v) / len(v), 2), lambda r: (_floats(r),)),
    Family(("value_range", "spread"), (("values", "List[int]"),), "int",
           ("Return the difference between the largest and the smallest value.",
            "How far apart are the extremes of a non-empty list of integers?"),
           lambda v: max(v) - min(v), lambda r: (_ints(r, n=(1, 6)),)),
    Family(("digit_product", "multiply_digits"), (("n", "int"),), "int",
           ("Return the product of the decimal digits of a non-negative integer.",
            "Multiply together all digits of the number n."),
           lambda n: math.prod(int(d) for d in str(n)), lambda r: (r.randint(0, 9999),)),
    Family(("is_leap_year", "leap_year"), (("year", "int"),), "bool",
           ("Return True if the year is a leap year in the Gregorian calendar.",
            "A year is a leap year if it is divisible by 4, except years divisible by 100 "
            "that are not divisible by 400. Check whether year is one."),
           lambda y: y % 4 == 0 and (y % 100 != 0 or y % 400 == 0),
           lambda r: (r.choice((1900, 2000, 2023, 2024, 1996, 2100, 1800, 2012)),)),
    Family(("celsius_to_fahrenheit", "to_fahrenheit"), (("celsius", "float"),), "float",
           ("Convert a temperature from degrees Celsius to degrees Fahrenheit.",
            "Return the Fahrenheit value of a Celsius temperature."),
           lambda c: round(c * 9 / 5 + 32, 1), lambda r: (round(r.uniform(-20, 40), 1),)),
    Family(("count_char", "occurrences_of"), (("text", "str"), ("char", "str")), "int",
           ("Return how many times char occurs in text.",
            "Count the occurrences of a single character in a string."),
           lambda s, c: s.count(c), lambda r: (_sentence(r, (1, 3)), r.choice("aeiorst"))),
    Family(("drop_negatives", "keep_non_negative"), (("values", "List[int]"),), "List[int]",
           ("Return the values that are zero or greater, in their original order.",
            "Remove every negative number from the list."),
           lambda v: [x for x in v if x >= 0], lambda r: (_ints(r, -5, 5),)),
    Family(("zip_to_dict", "pair_up"), (("keys", "List[str]"), ("values", "List[int]")),
           "Dict[str, int]",
           ("Build a dictionary that maps each key to the value at the same position.",
            "Combine a list of names and a list of numbers of the same length into a dict."),
           lambda k, v: dict(zip(k, v, strict=True)),
           lambda r: (lambda n: (r.sample(WORDS, n), _ints(r, n=(n, n))))(r.randint(0, 3))),
    Family(("initials", "name_initials"), (("full_name", "str"),), "str",
           ("Return the upper-case initials of a full name, separated by dots.",
            "Given a name such as 'ada king lovelace', return 'A.K.L.'."),
           lambda s: "".join(w[0].upper() + "." for w in s.split()),
           lambda r: (_sentence(r, (1, 3)),)),
    Family(("find_duplicates", "repeated_values"), (("values", "List[int]"),), "List[int]",
           ("Return the values that occur more than once, sorted, each listed once.",
            "Which numbers appear at least twice in the list? Return them in increasing "
            "order."),
           lambda v: sorted({x for x in v if v.count(x) > 1}), lambda r: (_ints(r, 0, 5),)),
    Family(("alternating_sum", "plus_minus_sum"), (("values", "List[int]"),), "int",
           ("Return values[0] - values[1] + values[2] - values[3] + ...",
            "Add the elements at even indices and subtract the elements at odd indices."),
           lambda v: sum(x if i % 2 == 0 else -x for i, x in enumerate(v)),
           lambda r: (_ints(r),)),
    Family(("triangular_number", "nth_triangular"), (("n", "int"),), "int",
           ("Return the n-th triangular number, the sum 1 + 2 + ... + n.",
            "Compute the number of dots in a triangle with n rows."),
           lambda n: n * (n + 1) // 2, lambda r: (r.randint(0, 12),)),
    Family(("split_even_odd", "partition_parity"), (("values", "List[int]"),),
           "Tuple[List[int], List[int]]",
           ("Return a tuple of the even values and the odd values, each in order.",
            "Separate a list of integers into its even and its odd numbers."),
           lambda v: ([x for x in v if x % 2 == 0], [x for x in v if x % 2]),
           lambda r: (_ints(r),)),
    Family(("snake_to_camel", "to_camel_case"), (("name", "str"),), "str",
           ("Convert a snake_case identifier to camelCase.",
            "Turn a name written with underscores into lower camel case."),
           _snake_to_camel, lambda r: ("_".join(r.sample(WORDS, r.randint(1, 3))),)),
    Family(("count_set_bits", "popcount"), (("n", "int"),), "int",
           ("Return how many 1 bits the binary representation of n has.",
            "Count the ones in the binary form of a non-negative integer."),
           lambda n: bin(n).count("1"), lambda r: (r.randint(0, 300),)),
    Family(("squeeze_spaces", "collapse_whitespace"), (("text", "str"),), "str",
           ("Replace every run of spaces with a single space and strip both ends.",
            "Normalize the spacing of a string: no leading, trailing or repeated spaces."),
           lambda s: " ".join(s.split()),
           lambda r: ("  ".join(r.sample(WORDS, 2)) + " " * r.randint(0, 3),)),
)


def _docstring(wording: str, examples: list[str], style: int) -> str:
    """The docstring block: opened after `\"\"\" `, on its own line, or right after the quotes."""
    lines = [wording] + examples
    body = "\n".join(f"    {ln}" for ln in lines)
    if style == 0:
        return f'    """ {body.lstrip()}\n    """\n'
    if style == 1:
        return f'    """\n{body}\n    """\n'
    return f'    """{body.lstrip()}\n    """\n'


def problem(fam: Family, rng: random.Random) -> str:
    """One problem of `fam`: name, wording, 1-3 examples and docstring style drawn by `rng`."""
    name = rng.choice(fam.names)
    examples = []
    for _ in range(rng.randint(1, 3)):
        args = fam.make(rng)
        try:
            result = fam.solve(*args)
        except (ValueError, ZeroDivisionError):
            continue
        call = ", ".join(repr(a) for a in args)
        examples += [f">>> {name}({call})", repr(result)]
    sig = ", ".join(f"{p}: {t}" for p, t in fam.params)
    text = " ".join(t for _, t in fam.params) + " " + fam.returns
    used = sorted(n for n in ("Dict", "List", "Optional", "Tuple") if n in text)
    header = f"from typing import {', '.join(used)}\n\n\n" if used else "\n\n"
    return (f"{header}def {name}({sig}) -> {fam.returns}:\n"
            + _docstring(rng.choice(fam.wordings), examples, rng.randrange(3)))


def problems(n: int, seed: int = 0) -> list[str]:
    """`n` problems, the families in turn (`n // len(FAMILIES)` or one more each), drawn with
    `seed`; the same `n` and `seed` give the same list."""
    rng = random.Random(seed)
    return [problem(FAMILIES[i % len(FAMILIES)], rng) for i in range(n)]
